"""An overlay directory that makes this ascend_fa importable, and its vLLM plugin
visible, in another Python environment (a vLLM one) without installing anything
there: put the directory on that environment's ``PYTHONPATH``.

The directory holds ``ascend_fa/`` -- symlinks to each entry of this package,
plus its ``backends`` and ``atb_ops`` subpackages (which a source checkout keeps
beside the package: pyproject's package-dir mapping; taken from the same
checkout) -- and
``ascend_fa-<version>.dist-info/`` with ``entry_points.txt`` naming
:data:`ENTRY_POINTS`, which vLLM's plugin loader (``importlib.metadata``) finds on
``sys.path``. Only ascend_fa itself is linked: its dependencies come from the
target environment (torch, safetensors, pydantic ...), not from this one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["ENTRY_POINTS", "build_overlay"]

#: The entry points the overlay declares (the same as pyproject.toml's).
ENTRY_POINTS = {"vllm.general_plugins": {"ascend_fa": "ascend_fa.serving:register"}}


def build_overlay(directory: str | Path) -> Path:
    """(Re)build the overlay at ``directory`` (replaced if it exists); returns it."""
    import ascend_fa

    out = Path(directory)
    src = Path(ascend_fa.__path__[0]).resolve()
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        shutil.rmtree(out)
    pkg = out / "ascend_fa"
    pkg.mkdir(parents=True)
    for entry in sorted(src.iterdir()):
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
    for sub in ("backends", "atb_ops"):
        # inside an installed package; beside the package in a source checkout
        if not (pkg / sub).exists():
            (pkg / sub).symlink_to(src.parent / sub)
    meta = out / f"ascend_fa-{ascend_fa.__version__}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: ascend-fa\nVersion: {ascend_fa.__version__}\n"
    )
    lines = []
    for group, entries in ENTRY_POINTS.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
        lines.append("")
    (meta / "entry_points.txt").write_text("\n".join(lines))
    return out
