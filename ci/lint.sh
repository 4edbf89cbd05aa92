#!/usr/bin/env bash
# Lint: ruff (rules and one formatting dialect) over the three layers, the tests
# and the tools; the native kernels' C sources against .clang-format (the
# clang-format pinned in the dev extra); the generated docs pages up to date; the
# documentation site built with every warning an error (mkdocs.yml, the `docs`
# extra; not --quiet, which hides the warnings from --strict).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
clang-format --dry-run --Werror atb_ops/csrc/*.c atb_ops/csrc/*.h
python ci/gen_docs.py --check
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir "$site"
