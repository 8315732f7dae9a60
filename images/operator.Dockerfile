# The weightcache operator: kopf and the kubernetes client, no torch (it never imports it).
# BASE: any image with python3 >= 3.10 and its venv module.
#
# Build from the repository root:
#   docker build -f images/operator.Dockerfile -t REGISTRY/weightcache-operator:0.1.0 .
# images/build.sh builds it with buildah instead (CI: on a local Debian base).
ARG BASE=docker.io/library/python:3.12-slim
FROM ${BASE}
LABEL org.opencontainers.image.title="weightcache-operator" org.opencontainers.image.licenses="Apache-2.0"
# a CA bundle for pip behind a TLS-intercepting proxy (images/build.sh passes its machine's)
ARG PIP_CERT
# The pip the image keeps, newer than the one the base's venv module bundles (scanners flag that one);
# images/minimum-versions.txt lists what no package of the image may be older than.
ARG PIP=pip==26.3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PATH=/opt/weightcache/bin:$PATH
COPY LICENSE /usr/share/doc/weightcache/LICENSE
# The operator's dependencies, installed before the package's source is copied (a change to the source
# installs none of them again): the `operator` extra's packages and pyyaml (tests/test_images.py checks
# these agree with pyproject.toml), not the distribution's core dependencies (torch, ...: the agent's),
# hence the package's --no-deps. setuptools (from the venv module) goes: nothing needs it at run time.
RUN python3 -m venv /opt/weightcache \
 && pip install --upgrade "$PIP" \
 && pip install "kopf>=1.37,<1.46" "kubernetes>=30,<38" "pyyaml>=6" \
 && pip uninstall -y setuptools
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE /src/
COPY node_agent /src/node_agent
COPY operator /src/operator
RUN pip install --no-deps /src && rm -rf /src
# The chart runs it as this non-root user with a read-only root filesystem.
USER 65532:65532
ENTRYPOINT ["weightcache-operator"]
CMD ["--all-namespaces"]
