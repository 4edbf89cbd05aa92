#!/usr/bin/env bash
# Unit tests. Default suite first (fast), then the tests marked slow.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
python -m pytest -q -m "not slow" "$@"
rc=0
python -m pytest -q -m slow "$@" || rc=$?
# Exit status 5 means "no tests collected" (no slow tests in this selection).
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
