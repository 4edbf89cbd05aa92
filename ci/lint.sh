#!/usr/bin/env bash
# Lint: ruff over the three layers, the tests and the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check ascend_fa backends atb_ops tests
