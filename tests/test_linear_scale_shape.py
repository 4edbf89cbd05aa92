"""A W8A8_DYNAMIC ``weight_scale`` / ``weight_offset`` is exactly ``[N, 1]``.

vllm-ascend creates both parameters ``[N, 1]`` and vLLM's ``weight_loader``
asserts that the file's tensor has the parameter's shape: vllm-ascend
0.23.0.post1's real loader raises AssertionError
(``vllm/model_executor/layers/linear.py`` L1525, ``RowParallelLinear``) on an
export whose scales are ``[N, 1, 1]`` and on one whose scales are ``[N]``, and
loads the same export with ``[N, 1]`` scales (``tests/test_vllm_ascend_loader.py``
runs it). msModelSlim 26.1.0's saver writes ``[N, 1]``
(``core/quant_service/modelslim_v1/save/ascendv1.py`` L341, its per-channel
scale ``[N]`` unsqueezed). Here ``--merge-into`` refuses an export with another
shape in one line naming the tensor and the failure, writes nothing, and
``inspect`` finds the same.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from builders import msmodelslim_export, save_tiny  # noqa: E402

from ascend_fa.artifact import inspect_artifact  # noqa: E402
from ascend_fa.cli import main  # noqa: E402

FAST = ["--num-samples", "3", "--max-length", "16", "--batch-size", "3"]
FAST += ["--heldout", "1", "-q"]
DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale_shape")
    src = save_tiny(root / "qwen3", "qwen3")
    export = root / "export"
    msmodelslim_export(export, src, quant_type="W8A8_DYNAMIC")
    return src, export


def _reshaped(export: Path, dst: Path, name: str, shape: tuple[int, ...]) -> Path:
    shutil.copytree(export, dst)
    (path,) = dst.glob("*.safetensors")
    tensors = load_file(path)
    tensors[name] = tensors[name].reshape(shape).contiguous()
    save_file(tensors, str(path))
    return dst


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()
    }


def test_the_export_as_written_is_valid(setup):
    _, export = setup
    (path,) = export.glob("*.safetensors")
    tensors = load_file(path)
    dynamic = [n for n in tensors if n.endswith((".weight_scale", ".weight_offset"))]
    assert dynamic
    for name in dynamic:
        rows = tensors[name.rpartition(".")[0] + ".weight"].shape[0]
        assert list(tensors[name].shape) == [rows, 1], name
    assert inspect_artifact(export)["valid"]


@pytest.mark.parametrize("part", ["weight_scale", "weight_offset"])
@pytest.mark.parametrize("shape", ["n11", "n"])
def test_another_scale_shape_is_refused(setup, tmp_path, capsys, part, shape):
    src, export = setup
    name = f"{DOWN}.{part}"
    rows = load_file(next(export.glob("*.safetensors")))[name].shape[0]
    new = (rows, 1, 1) if shape == "n11" else (rows,)
    bad = _reshaped(export, tmp_path / "bad", name, new)
    before = _tree(tmp_path)
    out = tmp_path / "merged"
    argv = ["calibrate", "--model", str(src), "--merge-into", str(bad)]
    capsys.readouterr()
    rc = main([*argv, "--output", str(out), *FAST])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    line = lines[0]
    assert line.startswith("ascend-fa calibrate: error: ") and str(bad) in line
    assert f"{name}: shape {list(new)}, expected [{rows}, 1]" in line, line
    assert "AssertionError" in line and "weight_loader" in line, line
    assert "linear.py@v0.23.0" in line and "L1525" in line, line
    assert not out.exists() and _tree(tmp_path) == before
    for extra in ([], ["--target", "vllm-ascend"], ["--target", "mindie"]):
        assert main(["inspect", str(bad), *extra]) == 1
        report = capsys.readouterr().out
        assert f"{name}: shape {list(new)}" in report and "AssertionError" in report
