"""vllm-ascend's real loader on W8A8_DYNAMIC scales of each shape (slow suite).

msModelSlim 26.1.0's own W8A8_DYNAMIC export (:mod:`msmodelslim_saver`: its
``LinearQuantProcessor`` and ``AscendV1Saver``) carries ``weight_scale`` /
``weight_offset`` ``[N, 1]``; a qwen3 C8 artifact ``--merge-into`` it loads in
vllm-ascend 0.18.0 and 0.23.0.post1 with every tensor in place. The same artifact
with those tensors ``[N, 1, 1]`` or ``[N]`` does not: vLLM's
``RowParallelLinear.weight_loader`` raises AssertionError (``linear.py``). Ours
must agree: ``inspect --consumer-version R`` exits 0 for the first and 1 naming
the AssertionError for the others, and ``calibrate --merge-into`` an export with
such scales exits 2 in one line, writing nothing. The environments and the driver
are those of ``tests/test_vllm_ascend_loader.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402
from msmodelslim_saver import genuine_export, saver_available  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_vllm_ascend_loader import (  # noqa: E402
    DRIVER,
    TEXTS,
    _env_python,
    _in_ci,
)

from ascend_fa import settings  # noqa: E402
from ascend_fa.cli import main  # noqa: E402

#: The registry releases whose loader this runs (qwen3 C8 loads in each), and
#: those a local run adds (``ASCEND_FA_LOADER_RELEASES``, as the matrix does).
RELEASES = ("0.23.0.post1", "0.18.0")
RELEASES += settings.get("ASCEND_FA_LOADER_RELEASES")
#: variant -> the shape its weight_scale / weight_offset get (N = rows)
SHAPES = {"n1": None, "n11": (-1, 1, 1), "n": (-1,)}


def _reshape_scales(src: Path, dst: Path, shape: tuple[int, ...]) -> Path:
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if name.endswith((".weight_scale", ".weight_offset")):
                tensors[name] = t.reshape(shape).contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


def _calibrate(src: Path, calib: Path, out: Path, export: Path, release: str) -> int:
    argv = ["calibrate", "--model", str(src), "--calib-data", str(calib)]
    argv += ["--num-samples", "4", "--max-length", "16", "--batch-size", "2"]
    argv += ["--heldout", "0", "--no-report", "--target", "vllm-ascend", "-q"]
    argv += ["--merge-into", str(export), "--consumer-version", release]
    return main([*argv, "--output", str(out)])


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict:
    why = saver_available()
    if why is not None:
        (pytest.fail if _in_ci() else pytest.skip)(why)
    root = tmp_path_factory.mktemp("va_scale_shape")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    # msModelSlim's saver refuses tied embeddings (shared tensors)
    src = save_tiny(
        root / "qwen3", "qwen3", dtype=torch.bfloat16, tie_word_embeddings=False
    )
    export = root / "export"
    genuine_export(export, src, quant_type="W8A8_DYNAMIC", part_file_size=0)
    merged = root / "n1"
    assert _calibrate(src, calib, merged, export, RELEASES[0]) == 0
    out = {"src": src, "calib": calib, "root": root, "n1": (merged, export)}
    for tag, shape in SHAPES.items():
        if shape is not None:
            out[tag] = (
                _reshape_scales(merged, root / tag, shape),
                _reshape_scales(export, root / f"export_{tag}", shape),
            )
    return out


@pytest.fixture(scope="module", params=RELEASES)
def loaded(request, artifacts, tmp_path_factory) -> tuple[str, dict]:
    release = request.param
    python = _env_python(release)
    req = tmp_path_factory.mktemp("req") / "request.json"
    req.write_text(json.dumps({"artifacts": [str(artifacts[t][0]) for t in SHAPES]}))
    proc = subprocess.run(
        [str(python), str(DRIVER), str(req)], capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["vllm_ascend"] == release or release == "main", out["vllm_ascend"]
    return release, {Path(r["artifact"]).name: r for r in out["results"]}


def test_the_exports_scales_are_n_by_1(artifacts):
    (path,) = artifacts["n1"][1].glob("*.safetensors")
    tensors = load_file(path)
    names = [n for n in tensors if n.endswith((".weight_scale", ".weight_offset"))]
    assert names
    for name in names:
        rows = tensors[name.rpartition(".")[0] + ".weight"].shape[0]
        assert list(tensors[name].shape) == [rows, 1], name


@pytest.mark.parametrize("tag", list(SHAPES))
def test_ours_is_the_real_loaders(tag, loaded, artifacts, tmp_path, capsys):
    release, results = loaded
    result = results[tag]
    path, export = artifacts[tag]
    capsys.readouterr()
    rc = main(["inspect", str(path), "--consumer-version", release])
    report = capsys.readouterr().out
    if tag == "n1":
        assert result["loaded"], result
        assert result["tensors"] and all(
            v.startswith("equal") for v in result["tensors"].values()
        ), result
        assert rc == 0, report
        return
    assert not result["loaded"] and result["error"].startswith("AssertionError")
    assert result["where"].startswith("vllm/model_executor/layers/linear.py:")
    assert rc == 1 and "AssertionError" in report and "weight_loader" in report
    out = tmp_path / "out"
    rc = _calibrate(artifacts["src"], artifacts["calib"], out, export, release)
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and not out.exists(), lines
    assert "AssertionError" in lines[0] and "linear.py" in lines[0], lines[0]
