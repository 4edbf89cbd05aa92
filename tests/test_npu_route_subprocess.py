"""The public API on tensors whose device is ``npu``, once per torch_npu release.

Each release runs in a subprocess (``npu_route_driver.py``): the fake ``npu``
device renames torch's PrivateUse1 backend, which cannot be undone in-process.
There the calls take the one dispatch route (public API -> ``torch.ops.ascend_fa``
-> the NPU backend's PrivateUse1 kernels -> the strict fake of torch_npu): cache
bytes equal the CPU reference, attention is within the device budget, the
documented refusals happen before any torch_npu call naming rule, value and
release, and the library self-test passes through the NPU backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ascend_fa.backends.npu_capabilities import RELEASES

TESTS = Path(__file__).parent


def _drive(release: str, *extra: str) -> dict:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        "PYTHONPATH": str(TESTS),
    }
    proc = subprocess.run(
        [sys.executable, str(TESTS / "npu_route_driver.py"), release, *extra],
        capture_output=True,
        text=True,
        cwd=TESTS,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["release"] == release
    failed = {k: v["detail"] for k, v in report["results"].items() if not v["ok"]}
    assert not failed, failed
    return report["results"]


@pytest.mark.parametrize("release", RELEASES)
def test_public_api_on_npu_tensors(release):
    assert len(_drive(release)) == 15


def _selftest(release: str) -> None:
    results = _drive(release, "selftest")
    assert results["selftest_library"]["ok"]


def test_selftest_library_through_the_npu_backend():
    _selftest("26.0.0")


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES[:-1])
def test_selftest_library_through_the_npu_backend_older_releases(release):
    _selftest(release)
