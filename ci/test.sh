#!/usr/bin/env bash
# The whole check a submission must pass: lint, unit tests (default + slow), the
# tiny-model tests again under transformers 4.57 (a second environment), benchmark
# smoke. This is the README's test command after installation.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/lint.sh
bash ci/unit.sh
bash ci/unit_transformers4.sh
bash ci/bench_smoke.sh
