#!/usr/bin/env bash
# Lint: ruff (rules and one formatting dialect) over the three layers, the tests
# and the README's Python snippets; then the layering rules of the architecture.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
