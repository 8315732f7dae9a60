# An engine image: vLLM's own image plus weightcache, which registers --load-format weightcache
# through vLLM's plugin entry point (nothing in vLLM is patched). Not built by CI.
#
# torch and CUDA: this image keeps the torch vLLM's image brings, and engines attach only to an
# agent image with the same torch major.minor and CUDA (docs/install.md, "Images"). Check with
#   docker run --rm --entrypoint python3 IMAGE -c 'import torch; print(torch.__version__, torch.version.cuda)'
# and build images/agent.Dockerfile with that torch (its TORCH and TORCH_INDEX build arguments).
#
# Build from the repository root:
#   docker build -f images/vllm.Dockerfile -t REGISTRY/weightcache-vllm:0.1.0 .
ARG BASE=docker.io/vllm/vllm-openai:v0.32.0
FROM ${BASE}
LABEL org.opencontainers.image.title="weightcache-vllm" org.opencontainers.image.licenses="Apache-2.0"
COPY LICENSE /usr/share/doc/weightcache/LICENSE
# a CA bundle for pip behind a TLS-intercepting proxy (images/build.sh passes its machine's)
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE /src/
COPY node_agent /src/node_agent
COPY operator /src/operator
# The cuda extra adds cuda-bindings (the VMM import of the arena). `weightcache build-native`
# compiles the row binder against vLLM's torch with the image's C++ compiler, or with a g++
# installed for that step only: the compilers vLLM's image carries (Triton's) stay.
RUN pip install "/src[cuda]" \
 && if command -v c++ >/dev/null; then weightcache build-native; \
    else apt-get update && apt-get install -y --no-install-recommends g++ && weightcache build-native \
      && apt-get purge -y --auto-remove g++ && rm -rf /var/lib/apt/lists/*; fi \
 && rm -rf /src
# vLLM's own server command, as in vLLM's image: the model is its first argument
ENTRYPOINT ["vllm", "serve"]
