# An engine image: SGLang's own image plus weightcache, which registers --load-format weightcache
# through SGLang's plugin entry point (sglang.srt.plugins; nothing in SGLang is patched). Not built by CI.
#
# torch and CUDA: this image keeps the torch SGLang's image brings (SGLang 0.5.17 pins torch 2.11.0),
# and engines attach only to an agent image with the same torch major.minor and CUDA
# (docs/install.md, "Images"): build images/agent.Dockerfile with that torch (its TORCH and
# TORCH_INDEX build arguments). Check with
#   docker run --rm --entrypoint python3 IMAGE -c 'import torch; print(torch.__version__, torch.version.cuda)'
#
# Build from the repository root:
#   docker build -f images/sglang.Dockerfile -t REGISTRY/weightcache-sglang:0.1.0 .
ARG BASE=docker.io/lmsysorg/sglang:v0.5.17
FROM ${BASE}
LABEL org.opencontainers.image.title="weightcache-sglang" org.opencontainers.image.licenses="Apache-2.0"
COPY LICENSE /usr/share/doc/weightcache/LICENSE
# a CA bundle for pip behind a TLS-intercepting proxy (images/build.sh passes its machine's)
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE /src/
COPY node_agent /src/node_agent
COPY operator /src/operator
# --no-deps: SGLang's image holds torch and the rest; the cuda extra's cuda-bindings is added by name.
# `weightcache build-native` compiles the row binder against SGLang's torch.
RUN pip install --no-deps /src "cuda-bindings>=12.6,<13.4" \
 && if command -v c++ >/dev/null; then weightcache build-native; \
    else apt-get update && apt-get install -y --no-install-recommends g++ && weightcache build-native \
      && apt-get purge -y --auto-remove g++ && rm -rf /var/lib/apt/lists/*; fi \
 && rm -rf /src
# SGLang's OpenAI-compatible server, as the EngineSet's template names it
ENTRYPOINT ["python3", "-m", "sglang.launch_server"]
