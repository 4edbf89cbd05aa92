"""The wheel maps backends/ and atb_ops/ under ascend_fa and ships nothing generic."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_layout(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
         "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("ascend_fa-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert tops <= {"ascend_fa", dist_info}, tops
    for required in (
        "ascend_fa/backends/registry.py",
        "ascend_fa/backends/npu.py",
        "ascend_fa/atb_ops/layout.py",
        "ascend_fa/calibration/recall.py",
        "ascend_fa/adapters/gqa.py",
        "ascend_fa/data/calib_default.jsonl",
        "ascend_fa/recipes/default.yaml",
    ):
        assert required in names, required
    assert not any(n.startswith(("backends/", "atb_ops/", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "ascend-fa = ascend_fa.cli:main" in text


def test_every_package_directory_is_listed():
    """A new subpackage missing from pyproject's explicit list would vanish from the
    wheel; catch it without building one."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
                 ["setuptools"]["packages"])  # fmt: skip
    found = set()
    for base, prefix in (("ascend_fa", "ascend_fa"), ("backends", "ascend_fa.backends"),
                         ("atb_ops", "ascend_fa.atb_ops")):  # fmt: skip
        for init in (ROOT / base).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / base).parts
            found.add(".".join((prefix, *rel)))
    assert found <= listed, sorted(found - listed)
