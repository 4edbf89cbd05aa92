"""A streaming calibration reads each layer once and resumes after a kill.

Real tiny checkpoints in several safetensors shards. The layer-major attention
pass loads every decoder layer exactly once (counted on the
:class:`~ascend_fa.streaming.StreamedModel`). A run killed after some layers (an
exception in-process; a real SIGKILL of ``python -m ascend_fa calibrate
--streaming``) resumes on rerun, says so in one line, and writes the artifact of an
uninterrupted run, tensor for tensor; a changed argument starts over.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_streaming import _assert_same_artifact, _checkpoint, _run

from ascend_fa.calibration.job import default_recipe_path
from ascend_fa.calibration.pipeline import calibrate_model
from ascend_fa.calibration.recipe import load_recipe
from ascend_fa.calibration.resume import (
    RESUME_FILE,
    ResumeState,
    open_resume,
    run_fingerprint,
)
from ascend_fa.streaming import open_streamed

#: Llama C8 loads from vllm-ascend 0.25.1rc1 on (ascend_fa.artifact.releases).
KW = dict(
    target="vllm-ascend",
    consumer_version="0.25.1rc1",
    linear="none",
    max_shard_size="40KB",
)


def _work(out: Path) -> Path:
    return out.parent / f".{out.name}.streaming"


def test_layer_major_pass_reads_each_layer_once(tmp_path):
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=4)
    loaded, streamed = open_streamed(src, tmp_path / "work")
    loads: Counter[int] = Counter()
    load_layer = streamed.load_layer

    def counting(i: int) -> None:
        loads[i] += 1
        load_layer(i)

    streamed.load_layer = counting  # type: ignore[method-assign]
    texts = [f"sample {i} " * (2 + i) for i in range(6)]
    recipe = load_recipe(default_recipe_path())
    for layerwise, reads in ((True, 1), (False, 3)):
        loads.clear()
        result = calibrate_model(
            loaded.model,
            loaded.tokenizer,
            texts,
            recipe=recipe,
            max_length=24,
            batch_size=2,
            progress=False,
            layerwise=layerwise,
        )
        result.remove(loaded.model)
        streamed.release()
        # three batches: batch-major reads every layer three times
        assert loads == dict.fromkeys(range(4), reads), layerwise
    streamed.close()


def test_progress_lines_per_layer_and_quiet(tmp_path, capsys):
    """One line per layer of the attention pass (no line with progress off)."""
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=3)
    _run(src, tmp_path / "a", tmp_path, streaming=True, progress=True, **KW)
    err = capsys.readouterr().err.splitlines()
    pattern = re.compile(
        r"attention layer (\d)/3: \d+ tok/s, RSS \d+ MiB \(peak \d+ MiB\), "
        r"\d+:\d\d:\d\d left"
    )
    ours = [m[1] for m in map(pattern.fullmatch, err) if m]
    assert ours == ["1", "2", "3"], err
    _run(src, tmp_path / "b", tmp_path, streaming=True, **KW)
    assert not capsys.readouterr().err


class _Killed(Exception):
    pass


def test_resume_after_an_interrupted_run_gives_the_same_artifact(
    tmp_path, monkeypatch, capsys
):
    """In-process (fast): the run dies after layer 2 of 4; the rerun resumes."""
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=4)
    whole = _run(src, tmp_path / "whole", tmp_path, streaming=True, **KW)
    out = tmp_path / "stream"
    save = ResumeState.save

    def dying(self, layer, model, inputs):
        save(self, layer, model, inputs)
        if layer == 1:
            raise _Killed

    monkeypatch.setattr(ResumeState, "save", dying)
    with pytest.raises(_Killed):
        _run(src, out, tmp_path, streaming=True, **KW)
    monkeypatch.undo()
    state = json.loads((_work(out) / RESUME_FILE).read_text())
    assert state["layers_done"] == 2 and not out.exists()
    capsys.readouterr()
    _run(src, out, tmp_path, streaming=True, **KW)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"resuming after layer 2 of 4 (attention pass) from {_work(out)}"]
    _assert_same_artifact(whole.output, out)
    assert not _work(out).exists()


def test_a_changed_argument_starts_over(tmp_path, monkeypatch, capsys):
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=3)
    out = tmp_path / "stream"
    save = ResumeState.save

    def dying(self, layer, model, inputs):
        save(self, layer, model, inputs)
        raise _Killed

    monkeypatch.setattr(ResumeState, "save", dying)
    with pytest.raises(_Killed):
        _run(src, out, tmp_path, streaming=True, **KW)
    monkeypatch.undo()
    capsys.readouterr()
    _run(src, out, tmp_path, streaming=True, seed=1, **KW)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "starting over: the calibration data, arguments changed since the "
        f"interrupted run in {_work(out)}"
    ]
    ref = _run(src, tmp_path / "ref", tmp_path, streaming=True, seed=1, **KW)
    _assert_same_artifact(ref.output, out)


def test_fingerprint_names_what_changed(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=2)
    base = run_fingerprint(src, ["a", "b"], {"seed": 0})
    assert base == run_fingerprint(src, ["a", "b"], {"seed": 0})
    assert run_fingerprint(src, ["a", "c"], {"seed": 0})["data"] != base["data"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(cfg))
    changed = run_fingerprint(src, ["a", "b"], {"seed": 0})
    assert [k for k in base if base[k] != changed[k]] == ["model"]
    work = tmp_path / "work"
    ResumeState(work, base).save_linears(0, [], [], [], None)
    state, line = open_resume(work, changed, 2)
    assert (
        line
        == f"starting over: the model files changed since the interrupted run in {work}"
    )
    assert not (work / RESUME_FILE).exists() and state.linear_done == 0
    (work / RESUME_FILE).write_text("{not json")
    state, line = open_resume(work, changed, 2)
    assert line == f"starting over: unreadable resume state in {work}"


W8A8 = dict(target="mindie", linear="w8a8", linear_fallback=2, max_length=16)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "layer", "line"),
    [
        ("save_linears", 1, "resuming after layer 2 of 3 (linear calibration)"),
        ("save", 0, "resuming after layer 1 of 3 (attention pass)"),
    ],
)
def test_w8a8_resume_in_either_pass(tmp_path, monkeypatch, capsys, method, layer, line):
    """W8A8 linears (smoothing, clipping, the layer-local fallback; Qwen2 has
    biases): interrupted in the linear calibration, the rerun puts the finished
    layers' quantized modules back from the spill files; interrupted in the
    attention pass, it also restores the linear records. Same artifact, report
    included (but its timings)."""
    src = _checkpoint(tmp_path / "src", "qwen2", num_hidden_layers=3)
    whole = _run(src, tmp_path / "whole", tmp_path, streaming=True, **W8A8)
    out = tmp_path / "stream"
    original = getattr(ResumeState, method)

    def dying(self, i, *args):
        original(self, i, *args)
        if i == layer:
            raise _Killed

    monkeypatch.setattr(ResumeState, method, dying)
    with pytest.raises(_Killed):
        _run(src, out, tmp_path, streaming=True, **W8A8)
    monkeypatch.undo()
    capsys.readouterr()
    _run(src, out, tmp_path, streaming=True, **W8A8)
    assert capsys.readouterr().err.splitlines() == [f"{line} from {_work(out)}"]
    _assert_same_artifact(whole.output, out)
    ra = json.loads((whole.output / "calibration_report.json").read_text())
    rb = json.loads((out / "calibration_report.json").read_text())
    assert ra["linears"] == rb["linears"] and ra == rb


def _cli(src: Path, out: Path, data: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ascend_fa",
        "calibrate",
        "--model",
        str(src),
        "--output",
        str(out),
        "--calib-data",
        str(data),
        "--num-samples",
        "8",
        "--max-length",
        "64",
        "--batch-size",
        "2",
        "--heldout",
        "2",
        "--target",
        "vllm-ascend",
        "--consumer-version",
        "0.25.1rc1",
        "--linear",
        "none",
        "--max-shard-size",
        "200KB",
        "--streaming",
        "--quiet",
    ]


@pytest.mark.slow
def test_sigkill_then_rerun_resumes_with_the_identical_artifact(tmp_path):
    """A real SIGKILL of ``python -m ascend_fa calibrate --streaming`` once the
    state of layer 2 is on disk; the rerun resumes and matches an uninterrupted
    run, every tensor."""
    src = _checkpoint(
        tmp_path / "src",
        "llama",
        num_hidden_layers=16,
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=12,
        num_key_value_heads=4,
    )
    texts = [f"line {i}: " + "the quick brown fox jumps " * 4 for i in range(12)]
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    ref = subprocess.run(
        _cli(src, tmp_path / "ref", data), env=env, capture_output=True, text=True
    )
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "out"
    state = _work(out) / RESUME_FILE
    proc = subprocess.Popen(
        _cli(src, out, data), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    done = 0
    while proc.poll() is None and time.monotonic() < deadline:
        if state.is_file():
            done = json.loads(state.read_text())["layers_done"]
            if done >= 2:
                os.kill(proc.pid, signal.SIGKILL)
                break
        time.sleep(0.002)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not out.exists()
    done = json.loads(state.read_text())["layers_done"]
    assert 2 <= done < 16
    rerun = subprocess.run(
        _cli(src, out, data), env=env, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stderr.splitlines() == [
        f"resuming after layer {done} of 16 (attention pass) from {_work(out)}"
    ]
    _assert_same_artifact(tmp_path / "ref", out)
    assert not _work(out).exists()


@pytest.mark.slow
def test_w8a8_dynamic_deepseek_resume_puts_the_routed_experts_back(
    tmp_path, monkeypatch, capsys
):
    """DeepSeek-V3 for vllm-ascend (W8A8_DYNAMIC, routed experts quantized per
    expert): interrupted after the MoE layer's linear calibration, the rerun puts
    that layer's quantized experts back from the spill file; same artifact."""
    kw = dict(target="vllm-ascend", linear="w8a8_dynamic", max_length=16)
    src = _checkpoint(tmp_path / "src", "deepseek_v3", num_hidden_layers=3)
    whole = _run(src, tmp_path / "whole", tmp_path, streaming=True, **kw)
    out = tmp_path / "stream"
    original = ResumeState.save_linears

    def dying(self, i, *args):
        original(self, i, *args)
        if i == 1:  # layer 1: the first MoE layer (first_k_dense_replace 1)
            raise _Killed

    monkeypatch.setattr(ResumeState, "save_linears", dying)
    with pytest.raises(_Killed):
        _run(src, out, tmp_path, streaming=True, **kw)
    monkeypatch.undo()
    capsys.readouterr()
    _run(src, out, tmp_path, streaming=True, **kw)
    line = "resuming after layer 2 of 3 (linear calibration)"
    assert capsys.readouterr().err.splitlines() == [f"{line} from {_work(out)}"]
    _assert_same_artifact(whole.output, out)
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model.layers.1.mlp.experts.0.down_proj.weight"] == "W8A8_DYNAMIC"
