"""Data-parallel calibration: real multi-process gloo runs give the artifact of one
process, bit for bit.

A tiny Llama (GQA, tied embeddings) is written as safetensors shards with a byte
tokenizer; 6 calibration samples in batches of 2 make 3 batches, so 2 ranks get an
uneven split (2 + 1) and 3 ranks over 2 batches leave one rank without a batch.
Compared: every tensor of the artifact (bytes), the description, the config and
every report section except the timings and the rank count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from builders import DEEPSEEK_TINY, MOE_TINY, byte_tokenizer, tiny_causal_lm
from safetensors import safe_open

from ascend_fa import parallel
from ascend_fa.calibration.job import calibrate
from ascend_fa.cli import main
from ascend_fa.errors import InputError

TEXTS = [
    f"Sample {i}: the quick brown fox jumps over {i * 7} lazy dogs" + " and" * i
    for i in range(10)
]
GQA = dict(
    vocab_size=260,
    max_position_embeddings=128,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
)
COMMON = dict(num_samples=6, max_length=24, batch_size=2, heldout=2)
ROOT = Path(__file__).resolve().parents[1]


#: Llama C8 loads from vllm-ascend 0.25.1rc1 on (ascend_fa.artifact.releases).
C8_RELEASE = ["--consumer-version", "0.25.1rc1"]


def _checkpoint(tmp: Path, model_type: str = "llama") -> tuple[Path, Path]:
    src = tmp / "src"
    cfg = GQA
    if model_type == "deepseek_v3":  # MLA, a dense first layer, routed + shared
        cfg = dict(vocab_size=260, max_position_embeddings=128, **DEEPSEEK_TINY)
    elif model_type in MOE_TINY:  # routed experts per token next to static W8A8
        cfg = {**GQA, **MOE_TINY[model_type]}
    model = tiny_causal_lm(model_type, attn=None, **cfg).to(torch.bfloat16)
    model.save_pretrained(src, max_shard_size="30KB")
    byte_tokenizer().save_pretrained(src)
    data = tmp / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return src, data


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def assert_same_artifact(one: Path, many: Path, ranks: int) -> None:
    """Bit-equal artifacts; the reports differ only in timings and rank count."""
    ta, tb = _tensors(one), _tensors(many)
    assert ta and set(ta) == set(tb)
    for name, t in ta.items():
        u = tb[name]
        assert t.dtype == u.dtype and t.shape == u.shape, name
        assert torch.equal(
            t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)
        ), name
    assert sorted(p.name for p in one.iterdir()) == sorted(
        p.name for p in many.iterdir()
    )
    for f in one.iterdir():
        if f.suffix == ".json" and f.name != "calibration_report.json":
            assert f.read_text() == (many / f.name).read_text(), f.name
    ra = json.loads((one / "calibration_report.json").read_text())
    rb = json.loads((many / "calibration_report.json").read_text())
    assert ra["calibration"].pop("ranks") == 1
    assert rb["calibration"].pop("ranks") == ranks
    assert ra == rb  # no timing in a report: it is part of the artifact


# -- two spawned processes calling the library (default suite) ----------------


def _worker(rank: int, init: str, src: str, data: str, out: str, kw: dict) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2
    )
    try:
        assert parallel.world_size() == 2 and parallel.rank() == rank
        assert parallel.batch_share(6, 2) == [(0, 4), (4, 6)][rank]
        calibrate(src, output=out, calib_data=data, **kw)
        assert dist.is_initialized()  # a caller's group is left to the caller
        # the caller's teardown, as the library's own group does it: no rank
        # destroys its group while another still works (rank 0 writing)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_spawned_ranks_equal_one_process_w8a8(tmp_path):
    """MindIE W8A8 (SmoothQuant + range search per group, layer-local fallback on
    the scan data) and FAQuant scales: 2 gloo ranks, 2 + 1 batches, one writer."""
    src, data = _checkpoint(tmp_path)
    kw = dict(
        COMMON,
        target="mindie",
        linear="w8a8",
        linear_fallback=2,
        picture_report=False,
        progress=False,
    )
    one = calibrate(src, output=tmp_path / "one", calib_data=data, **kw)
    assert one.report["linears"]["layer_error"]  # the fallback scan ran
    before = set(os.listdir(tmp_path))
    mp.spawn(
        _worker,
        args=(str(tmp_path / "store"), str(src), str(data), str(tmp_path / "two"), kw),
        nprocs=2,
        join=True,
    )
    assert_same_artifact(one.output, tmp_path / "two", ranks=2)
    # rank 1 wrote nothing: only the artifact and the rendezvous file are new
    assert set(os.listdir(tmp_path)) - before <= {"two", "store"}


def _leave_worker(rank: int, port: int, out: str, fail: bool) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ASCEND_FA_DIST_TIMEOUT="60",
    )
    done = Path(out) / "rank0.done"
    try:
        with parallel.process_group(torch.device("cpu")):
            if rank == 0:
                time.sleep(1.5)  # rank 0 "writes" long after rank 1 is done
                if fail:
                    raise RuntimeError("rank 0 failed")
                done.write_text("written")
    except RuntimeError:
        assert rank == 0 and fail
        return
    # rank 1 leaves the group only after rank 0 has finished its block
    assert not dist.is_initialized()
    (Path(out) / f"rank{rank}.left").write_text(str(done.exists()))


@pytest.mark.parametrize("fail", [False, True], ids=["both-finish", "rank0-fails"])
def test_process_group_ranks_leave_together(tmp_path, fail):
    """A rank that is done waits for the others before it destroys the group (no
    teardown while rank 0 still works); when rank 0 fails, rank 1 still leaves
    cleanly (the failed barrier is rank 0's error, not a second one)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_leave_worker, args=(port, str(tmp_path), fail), nprocs=2, join=True)
    left = (tmp_path / "rank1.left").read_text()
    assert left == ("False" if fail else "True")
    assert (tmp_path / "rank0.left").exists() != fail


def test_batch_share_is_contiguous_whole_batches(monkeypatch):
    """Naive reference: deal the batches out in order, the first ranks one more."""
    for items, bs, world in [(6, 2, 2), (4, 2, 3), (7, 3, 2), (1, 4, 3), (9, 1, 4)]:
        batches = [list(range(i, min(i + bs, items))) for i in range(0, items, bs)]
        got = []
        for r in range(world):
            monkeypatch.setattr(parallel, "is_active", lambda: True)
            monkeypatch.setattr(parallel, "world_size", lambda w=world: w)
            monkeypatch.setattr(parallel, "rank", lambda r=r: r)
            got.append(parallel.batch_share(items, bs))
        expect, at = [], 0
        for r in range(world):
            n = len(batches) // world + (1 if r < len(batches) % world else 0)
            mine = [i for b in batches[at : at + n] for i in b]
            expect.append((mine[0], mine[-1] + 1) if mine else None)
            at += n
        for (start, stop), e in zip(got, expect):
            assert (None if start == stop else (start, stop)) == e
        assert got[0][0] == 0 and got[-1][1] == items
    monkeypatch.undo()
    assert parallel.batch_share(5, 2) == (0, 5)  # no process group


def test_bad_setup_is_one_line(monkeypatch, tmp_path, capsys):
    src, data = _checkpoint(tmp_path)
    capsys.readouterr()
    argv = [
        "calibrate",
        "--model",
        str(src),
        "--calib-data",
        str(data),
        "--output",
        str(tmp_path / "out"),
        "--linear",
        "none",
        "--target",
        "vllm-ascend",
        "--consumer-version",
        "0.25.1rc1",  # Llama C8 loads from 0.25.1rc1 on
    ]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RANK=None in the environment" in err[0]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("ASCEND_FA_DIST_TIMEOUT", "soon")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ascend-fa calibrate: error: ASCEND_FA_DIST_TIMEOUT='soon': expected a "
        "positive number"
    ]
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="--clip-search is not data-parallel"):
        calibrate(
            src,
            output=tmp_path / "out",
            calib_data=data,
            target="mindie",
            linear="w8a8",
            clip_search=True,
        )
    with pytest.raises(InputError, match="device 'meta'"):
        parallel.comm_backend(torch.device("meta"))


# -- torchrun (slow) ----------------------------------------------------------


def _cli_args(src: Path, data: Path, out: Path, extra: list[str]) -> list[str]:
    args = ["calibrate", "--model", str(src), "--calib-data", str(data)]
    for k, v in COMMON.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return [*args, "--no-report", "--output", str(out), *extra]


def _torchrun(ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a free port: parallel runs do not collide
            "--nproc_per_node",
            str(ranks),
            "-m",
            "ascend_fa",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "ranks", "samples"),
    [
        # not split: the scan data, the transforms' and the budget's samples run
        # whole on every rank (the same decisions without a reduction)
        (
            [
                "--linear-fallback-criterion",
                "kl",
                "--linear-fallback",
                "2",
                "--error-budget",
                "0.5",
                "--transforms",
                "v-rotation,qk-smoothing",
            ],
            2,
            6,
        ),
        (["--target", "vllm-ascend", "--streaming", "--model-type=deepseek_v3"], 2, 6),
        (["--linear", "w8a8"], 2, 6),
        (["--model-type=qwen2_moe"], 2, 6),
        (["--linear", "w8a8", "--streaming"], 2, 6),
        (["--linear", "w8a8", "--streaming", "--linear-fallback", "0"], 3, 4),
        (["--linear", "none", "--target", "vllm-ascend", *C8_RELEASE], 2, 6),
        (
            ["--linear", "none", "--target", "vllm-ascend", *C8_RELEASE, "--streaming"],
            2,
            6,
        ),
        (["--linear", "none", "--target", "vllm", "--kv-strategy", "attn_head"], 2, 6),
    ],
    ids=[
        "kl-budget-transforms",
        "deepseek-mla-streaming",
        "w8a8",
        "moe-mindie-default",
        "w8a8-streaming",
        "w8a8-streaming-empty-rank",
        "c8",
        "c8-streaming",
        "fp8-kv",
    ],
)
def test_torchrun_equals_one_process(tmp_path, capsys, extra, ranks, samples):
    """``torchrun -m ascend_fa calibrate``: rank 0 prints and writes; the artifact
    equals one process's (3 ranks over 2 batches: one rank runs no batch)."""
    kind = [e for e in extra if e.startswith("--model-type=")]
    extra = [e for e in extra if e not in kind]
    src, data = _checkpoint(tmp_path, kind[0].split("=")[1] if kind else "llama")
    extra = [*extra, "--num-samples", str(samples)]
    # torchrun runs each rank with OMP_NUM_THREADS=1: the reference uses one
    # intra-op thread too (some CPU float reductions, e.g. the MoE experts', round
    # differently with another thread count; the split itself changes no bit)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(_cli_args(src, data, tmp_path / "one", extra)) == 0
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    run = _torchrun(ranks, _cli_args(src, data, tmp_path / "many", extra))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1
    assert f"data-parallel calibration: {ranks} ranks (gloo)" in run.stdout
    assert_same_artifact(tmp_path / "one", tmp_path / "many", ranks)
    assert not list(tmp_path.glob(".*streaming*"))  # every rank's spill is gone


@pytest.mark.slow
def test_torchrun_input_error_is_one_line(tmp_path):
    """An input error every rank finds: rank 0 says it once, all ranks end."""
    src, data = _checkpoint(tmp_path)
    bad = ["--target", "vllm", "--clip-search"]  # clip search tunes FAQuant only
    run = _torchrun(2, _cli_args(src, data, tmp_path / "out", bad))
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("ascend-fa")]
    assert len(ours) == 1 and "--clip-search tunes FAQuant" in ours[0], run.stderr
    assert not (tmp_path / "out").exists()
