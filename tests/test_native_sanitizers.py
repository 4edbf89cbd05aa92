"""The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer: the
library is built with ``SANITIZE_FLAGS`` (and ``-Werror``), and the native tests
run against it in a subprocess whose Python starts with the compiler's ASan
runtime preloaded (a library loaded by ctypes cannot bring ASan in late). Every
report is fatal. First the setup is shown to catch a real out-of-bounds read and
a division by zero, so a clean run means something."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ascend_fa.atb_ops import native
from ascend_fa.atb_ops.native import (
    SANITIZE_FLAGS,
    build_library,
    native_status,
)

ROOT = Path(__file__).resolve().parents[1]

#: The tests of the native kernels (each compares them with the eager path).
NATIVE_TESTS = (
    "tests/test_native_cache_write.py",
    "tests/test_native_decode.py",
    "tests/test_native_fp8.py",
    "tests/test_native_linear.py",
)

#: Loads the sanitized library in place of the cached one, then runs its
#: arguments: ``pytest`` (the rest are pytest's arguments) or ``probe <kind>``.
DRIVER = """
import sys
from ascend_fa.atb_ops.native import load_library, native_kernels, native_status
load_library(sys.argv[1])
print("library:", native_status().path, flush=True)
if sys.argv[2] == "pytest":
    import pytest
    sys.exit(pytest.main(sys.argv[3:]))
import torch
lib = native_kernels()._lib
if sys.argv[3] == "overflow":
    # 1000 floats, read as 1008: the last vector runs past the allocation
    x, out = torch.zeros(1000), torch.empty(1008, dtype=torch.int8)
    lib.afa_quantize(x.data_ptr(), 2, 1008, 1.0, out.data_ptr())
else:
    # zero KV heads: the group size h / hkv divides by zero
    lib.afa_gqa_decode(None, None, None, 0, None, 0, 0, 16, None, 1, None, 0, 8,
                       128, 0, 0, 1, None)
print("no report", flush=True)
"""


def _runtime(cc: str, name: str) -> str | None:
    """The absolute path of the compiler's runtime library ``name``, or None."""
    out = subprocess.run(
        [cc, f"-print-file-name={name}"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    """(library path, environment) of the sanitizer run."""
    status = native_status()
    if not status.available:
        if status.compiler is not None:
            pytest.fail(f"native kernels failed to build: {status.reason}")
        pytest.skip(f"native kernels unavailable: {status.reason}")
    cc = native._find_compiler()
    asan = _runtime(cc, "libasan.so")
    if asan is None:
        pytest.skip(f"{cc} has no AddressSanitizer runtime (libasan.so)")
    path = build_library(
        tmp_path_factory.mktemp("asan"), cc, werror=True, extra_flags=SANITIZE_FLAGS
    )
    # libstdc++ right after the ASan runtime: torch throws C++ exceptions (an
    # index out of range), and ASan's __cxa_throw interceptor needs it loaded
    # when ASan starts
    preload = [asan, *filter(None, [_runtime(cc, "libstdc++.so.6")])]
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(preload),
        # CPython and torch keep allocations until exit: leaks are not ours
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    }
    env.pop("ASCEND_FA_NATIVE", None)
    return path, env


def _drive(sanitized, *args: str, timeout: int) -> subprocess.CompletedProcess:
    path, env = sanitized
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "probe, report, where",
    [
        ("overflow", "AddressSanitizer: heap-buffer-overflow", "cache_write.c"),
        ("divide", "runtime error: division by zero", "gqa_decode.c"),
    ],
)
def test_sanitizers_catch_a_bad_call(sanitized, probe, report, where):
    """The setup works: a read past a tensor and an integer division by zero in
    a kernel each stop the process with the sanitizer's report at the line."""
    proc = _drive(sanitized, "probe", probe, timeout=600)
    assert proc.returncode != 0, proc.stdout
    assert "no report" not in proc.stdout
    assert report in proc.stderr, proc.stderr[-3000:]
    assert where in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_native_tests_pass_under_asan_and_ubsan(sanitized):
    """Every default-suite test of the native kernels passes against the
    sanitized library with no report (the private-cache test builds a library
    of its own and is left out). ``--capture=sys`` keeps a report on the real
    stderr, where an aborting process can still write it."""
    path, _ = sanitized
    proc = _drive(
        sanitized, "pytest", "-q", "-x", "-m", "not slow", "--capture=sys",
        "-p", "no:cacheprovider", "-k", "not private_directory", *NATIVE_TESTS,
        timeout=1800,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert f"library: {path}" in proc.stdout
    assert "Sanitizer" not in out and "runtime error" not in out, out[-5000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
