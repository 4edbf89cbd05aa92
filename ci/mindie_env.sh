#!/usr/bin/env bash
# A Python environment for running MindIE-LLM's own model construction on a CPU
# (tests/test_mindie_own_code.py; the source tree itself is named by MINDIE_LLM_SRC,
# never installed). MindIE-LLM 3.0.0's atb_llm is written for transformers 4.x
# (`from transformers.modeling_utils import PretrainedConfig`) and its mindie_llm
# imports numba at module level; torch and the rest come from the system
# site-packages. torch_npu, pyACL's acl and the ATB libraries are the stand-ins
# under tests/mindie_stub, put on the path by tests/mindie_own_driver.py.
# The environment is built beside its final place and renamed into it once it
# imports both, so an interrupted install leaves nothing that looks ready.
#   [PYTHON=python3] bash ci/mindie_env.sh [DIR]
# DIR defaults to $ASCEND_FA_CACHE_DIR (else $XDG_CACHE_HOME/ascend-fa, else
# ~/.cache/ascend-fa)/mindie-llm-env. Prints DIR on the last line.
set -euo pipefail
root="${ASCEND_FA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ascend-fa}"
dir="${1:-$root/mindie-llm-env}"
python="${PYTHON:-python3}"
ready='import transformers, numba, torch, safetensors
assert transformers.__version__.startswith("4.57."), transformers.__version__'
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "$ready" >/dev/null 2>&1; then
  echo "$dir"
  exit 0
fi
mkdir -p "$(dirname "$dir")"
tmp="$(mktemp -d "$dir.partial.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv --system-site-packages "$tmp"
# --retries 0: an unreachable extra index answers at once instead of backing off
"$tmp/bin/python" -m pip install -q --retries 0 "transformers==4.57.*" numba
"$tmp/bin/python" -c "$ready"
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
# a venv's scripts name its own path: rewrite them for the final place
sed -i "s#$tmp#$dir#g" "$dir"/bin/* 2>/dev/null || true
"$dir/bin/python" -c "$ready"
echo "$dir"
