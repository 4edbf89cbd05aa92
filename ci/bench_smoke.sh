#!/usr/bin/env bash
# Benchmarks smoke run: every benchmark at --quick sizes must run to completion.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
for name in $(python -c "from ascend_fa.benchmarks import benchmark_names; print(' '.join(benchmark_names()))"); do
  echo "== ascend-fa bench $name --quick"
  ascend-fa bench "$name" --quick
done
