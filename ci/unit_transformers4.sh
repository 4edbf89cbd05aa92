#!/usr/bin/env bash
# The second test environment: the tests marked `transformers4` (calibrate / eval /
# emulate / inspect on tiny llama, qwen2, qwen3, mistral and deepseek_v3 models,
# and the transformers shims) under transformers 4.57, the last 4.x, which
# pyproject.toml supports beside 5.x.
#
# The environment is a venv beside the checkout (.venv-tf4/, gitignored) that sees
# the system site-packages (torch, pytest, ...) and holds only this checkout
# (editable) and transformers 4.57 with the huggingface_hub / tokenizers it needs.
# It is reused when it already has transformers 4.57.x and this checkout's code;
# otherwise it is built again. ASCEND_FA_TF4_VENV names another place.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$(pwd -P)
venv=${ASCEND_FA_TF4_VENV:-$root/.venv-tf4}
py="$venv/bin/python"

ready() {
  [ -x "$py" ] && "$py" - "$root" <<'PY' >/dev/null 2>&1
import os
import sys

import transformers

import ascend_fa

assert transformers.__version__.startswith("4.57."), transformers.__version__
here = os.path.realpath(os.path.dirname(ascend_fa.__file__))
assert here == os.path.join(os.path.realpath(sys.argv[1]), "ascend_fa"), here
PY
}

t0=$(date +%s)
if ! ready; then
  echo "== building the transformers 4.57 environment in $venv"
  rm -rf "$venv"
  python -m venv --system-site-packages "$venv"
  "$py" -m pip install -q --no-deps -e .
  "$py" -m pip install -q "transformers==4.57.*"
  if ! ready; then
    echo "ci/unit_transformers4.sh: $venv does not import transformers 4.57 and this checkout" >&2
    exit 1
  fi
fi
t1=$(date +%s)
echo "== transformers $("$py" -c 'import transformers; print(transformers.__version__)') environment ready in $((t1 - t0)) s"
# -p no:cacheprovider: the default run's .pytest_cache is left as it was.
"$py" -m pytest -q -p no:cacheprovider -m transformers4 "$@"
echo "== transformers 4.57 tests took $(($(date +%s) - t1)) s"
