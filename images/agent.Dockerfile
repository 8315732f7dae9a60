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
ARG BASE=docker.io/nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${BASE}
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
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE /src/
COPY node_agent /src/node_agent
COPY operator /src/operator
# A compiler only while building: setup.py's C extensions, then `weightcache build-native`, which
# compiles the row binder against the torch above, beside the package (where engines look first).
# Every Debian package this step installs (compilers, binutils, headers) is purged after it, the
# downloaded .debs with them; setuptools goes too (nothing in the image needs it at run time).
RUN dpkg-query -W -f '${Package}\n' | sort > /var/tmp/packages-before \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc g++ python3-dev \
 && pip install "/src[cuda]" \
 && weightcache build-native \
 && dpkg-query -W -f '${Package}\n' | sort | comm -13 /var/tmp/packages-before - \
    | xargs -r env DEBIAN_FRONTEND=noninteractive apt-get purge -y \
 && apt-get clean && rm -rf /var/lib/apt/lists/* /var/tmp/packages-before /src \
 && pip uninstall -y setuptools
# The DaemonSet passes the rest: --model, --socket-dir, --tp-size, --devices, --http-port, ...
ENTRYPOINT ["weightcache", "agent"]
