#!/usr/bin/env bash
# Lint: ruff (rules and one formatting dialect) over the three layers, the tests
# and the README's Python snippets; the native kernels' C sources against
# .clang-format (the clang-format pinned in the dev extra); then the layering
# rules of the architecture.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
clang-format --dry-run --Werror atb_ops/csrc/*.c atb_ops/csrc/*.h
