#!/usr/bin/env bash
# Benchmarks smoke run: every benchmark at --quick sizes must run to completion.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
for name in $(python -c "from ascend_fa.cli.bench import _bench_modules; print(' '.join(m.NAME for m in _bench_modules()))"); do
  echo "== ascend-fa bench $name --quick"
  ascend-fa bench "$name" --quick
done
