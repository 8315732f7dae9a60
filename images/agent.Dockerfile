# The weightcache node agent (also an engine image for the reference engine): Python, torch,
# weightcache with the `cuda` extra (cuda-bindings), and the torch-native attach binder compiled
# against that very torch.
#
# torch and CUDA: a cache's fingerprint holds the torch major.minor and, on GPUs, the CUDA
# version, so engines attach only where their image has the same torch major.minor and CUDA as
# this one (docs/install.md, "Images"). Defaults: torch 2.13.0 built for CUDA 13.0, on a CUDA 13.0
# base. Build engine images with the same TORCH and TORCH_INDEX, or change both images together.
#
# Build from the repository root:
#   docker build -f images/agent.Dockerfile -t REGISTRY/weightcache-agent:0.1.0 .
# images/build.sh builds it with buildah instead (and is how CI builds it, on a local Debian base
# with a CPU torch wheel: --build-arg BASE=... TORCH=/tmp/torch-...whl TORCH_INDEX=https://pypi.org/simple).
#
# Three stages, so that a change to the package's source, with a layer cache (docker build's,
# images/build.sh's), rebuilds only the steps that read it: `runtime` (Python, torch, the package's
# dependencies), `build` on it (the compilers, the row binder compiled from its own sources, the
# package's wheel with its C extensions), and the image: `runtime`, the wheel installed, and
# `weightcache build-native` placing the row binder. The compilers never reach the image.
ARG BASE=docker.io/nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${BASE} AS runtime
LABEL org.opencontainers.image.title="weightcache-agent" org.opencontainers.image.licenses="Apache-2.0"
# a CA bundle for pip behind a TLS-intercepting proxy (images/build.sh passes its machine's)
ARG PIP_CERT
# A requirement or a wheel file, and the index it and its dependencies come from.
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
# The pip the image keeps, newer than the one the base's venv module bundles (scanners flag that one);
# images/minimum-versions.txt lists what no package of the image may be older than.
ARG PIP=pip==26.3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PATH=/opt/weightcache/bin:$PATH
COPY LICENSE /usr/share/doc/weightcache/LICENSE
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/weightcache \
 && pip install --upgrade "$PIP" \
 && pip install "$TORCH" --index-url "$TORCH_INDEX"
# The package's dependencies and its `cuda` extra, as pyproject.toml lists them (read with tomllib:
# Python 3.11 or later), installed before its source is copied: a change to the source installs none
# of them again. setuptools goes (nothing in the image needs it at run time).
COPY pyproject.toml /var/tmp/weightcache/
RUN python3 -c 'import tomllib; p = tomllib.load(open("/var/tmp/weightcache/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["cuda"]))' > /var/tmp/weightcache/requirements.txt \
 && pip install -r /var/tmp/weightcache/requirements.txt \
 && pip uninstall -y setuptools \
 && rm -rf /var/tmp/weightcache

# The compilers and headers, in a stage of their own: the image is built on `runtime` again, below.
FROM runtime AS build
ARG PIP_CERT
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc g++ python3-dev
# The row binder, compiled against the torch above by the module `weightcache build-native` runs (it
# imports nothing else of the package), from its sources alone: compiled again only when they, the
# module or torch change. The image's `weightcache build-native` takes this build through
# images/prebuilt-c++, a compiler that copies it.
COPY node_agent/weightcache_agent/client/native_build.py node_agent/weightcache_agent/client/_bindtorch.cpp \
     node_agent/weightcache_agent/client/_bindtorch.h /build/native/
RUN python3 -c 'import pathlib, sys; sys.path.insert(0, "/build/native"); import native_build; \
print(native_build.build(pathlib.Path("/build/out")))'
COPY images/prebuilt-c++ /build/out/c++
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE /src/
COPY node_agent /src/node_agent
COPY operator /src/operator
RUN pip wheel --no-deps --wheel-dir /build/out /src

# The image: the wheel installed, and `weightcache build-native` run as on any machine, its compiler
# the copy of the build above (one that differs in torch, Python or source fails the step).
FROM runtime
COPY --from=build /build/out /build
RUN pip install --no-deps /build/weightcache-*.whl \
 && CXX=/build/c++ weightcache build-native \
 && rm -rf /build
# The DaemonSet passes the rest: --model, --socket-dir, --tp-size, --devices, --http-port, ...
ENTRYPOINT ["weightcache", "agent"]
