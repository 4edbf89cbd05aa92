"""The wheel maps backends/ and atb_ops/ under ascend_fa and ships nothing generic."""

from __future__ import annotations

import fnmatch
import os
import pathlib
import shutil
import site as pysite
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
        # the native kernels' C sources, compiled on first use
        "ascend_fa/atb_ops/csrc/afa_native.h",
        "ascend_fa/atb_ops/csrc/afa_internal.h",
    ):
        assert required in names, required
    csrc = sorted(p.name for p in (ROOT / "atb_ops" / "csrc").iterdir())
    assert [n.rsplit("/", 1)[1] for n in names if "/atb_ops/csrc/" in n] == csrc
    assert not any(n.startswith(("backends/", "atb_ops/", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "ascend-fa = ascend_fa.cli:main" in text
    # installed from the wheel, the kernels build from the shipped sources
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q",
         "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    code = (
        "from ascend_fa.atb_ops import native; s = native.native_status();"
        "print(native.CSRC_DIR); print(s.available, s.reason)"
    )
    # -S: no .pth files, so an editable install of this checkout cannot shadow
    # the wheel's copy (nor can the checkout itself: cwd elsewhere); the
    # interpreter's site-packages come after it
    path = os.pathsep.join([str(site), *pysite.getsitepackages()])
    env = {**os.environ, "PYTHONPATH": path,
           "ASCEND_FA_NATIVE_CACHE": str(tmp_path / "cache"),
           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # fmt: skip
    env.pop("ASCEND_FA_NATIVE", None)
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True,
        check=True, timeout=600, cwd=tmp_path,
    ).stdout.splitlines()  # fmt: skip
    assert out[0] == str(site / "ascend_fa" / "atb_ops" / "csrc"), out
    if shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc"):
        assert out[1].startswith("True"), out


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


def test_native_sources_are_package_data():
    """Every file of atb_ops/csrc matches pyproject's package-data globs for
    ascend_fa.atb_ops (a new kind of file would silently miss the wheel)."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data["package-data"]["ascend_fa.atb_ops"]
    files = sorted((ROOT / "atb_ops" / "csrc").iterdir())
    assert files
    for path in files:
        rel = path.relative_to(ROOT / "atb_ops").as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel
