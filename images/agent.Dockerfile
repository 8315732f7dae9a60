# The weightcache node agent: CUDA runtime, torch for that CUDA, cuda-bindings (the `cuda` extra).
# Build from the repository root:  docker build -f images/agent.Dockerfile -t ghcr.io/weightcache/agent:0.1.0 .
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
ENV PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip util-linux \
 && rm -rf /var/lib/apt/lists/*
# torch first, from the index that matches the base image's CUDA.
RUN pip install "torch>=2.4,<3" --index-url https://download.pytorch.org/whl/cu128
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY node_agent node_agent
COPY operator operator
# A compiler only for the install: it builds the attach loop's C extension (setup.py).
RUN apt-get update && apt-get install -y --no-install-recommends gcc python3-dev \
 && pip install ".[cuda]" \
 && apt-get purge -y gcc python3-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* /src
WORKDIR /
# The DaemonSet passes the rest: --model, --socket-dir, --tp-size, --devices, --http-port, ...
ENTRYPOINT ["weightcache", "agent"]
