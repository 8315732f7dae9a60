# An engine image: vLLM's own image plus weightcache, which registers --load-format weightcache
# through vLLM's plugin entry point (nothing in vLLM is patched).
# Build from the repository root:  docker build -f images/vllm.Dockerfile -t REGISTRY/weightcache-vllm:0.1.0 .
FROM vllm/vllm-openai:v0.32.0
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY node_agent node_agent
COPY operator operator
# vLLM's image already holds torch; the cuda extra adds cuda-bindings (the VMM import of the arena).
RUN pip install ".[cuda]" && rm -rf /src
WORKDIR /
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
