#!/usr/bin/env bash
# Benchmarks smoke run: every benchmark (`ascend-fa bench --help` lists them; each has
# --quick) runs at --quick sizes on the CPU and writes --json; each file must be a
# result document of the one schema (ascend-fa-bench/1, every record complete).
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for name in $(python -c "from ascend_fa.benchmarks import benchmark_names; print(' '.join(benchmark_names()))"); do
  echo "== ascend-fa bench $name --quick --json"
  ascend-fa bench "$name" --quick --backend cpu --json "$out/$name.json"
  python - "$out/$name.json" "$name" <<'PY'
import sys

from ascend_fa.benchmarks.results import check_results

doc = check_results(sys.argv[1], sys.argv[2])
print(f"== {sys.argv[2]}: {len(doc['records'])} records in schema {doc['schema']}")
PY
done
