# The weightcache operator: kopf + the kubernetes client, no torch (it never imports it).
# Build from the repository root:  docker build -f images/operator.Dockerfile -t ghcr.io/weightcache/operator:0.1.0 .
FROM python:3.12-slim
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY node_agent node_agent
COPY operator operator
# --no-deps: the distribution's core dependencies (torch, ...) are the agent's, not the operator's.
RUN pip install --no-cache-dir --no-deps . \
 && pip install --no-cache-dir "kopf>=1.37,<2" "kubernetes>=30" "pyyaml>=6" \
 && rm -rf /src
WORKDIR /
# The chart runs it as this non-root user with a read-only root filesystem.
USER 65532:65532
ENTRYPOINT ["weightcache", "operator"]
CMD ["--all-namespaces"]
