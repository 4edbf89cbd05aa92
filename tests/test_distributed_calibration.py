"""Two gloo processes, each with half the batches, reduce to the single-process state
bit for bit (observers directly and through FA3Processor.postprocess)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ascend_fa.calibration import (
    FA3Processor,
    FA3QuantConfig,
    PerHeadObserver,
    all_reduce_observer,
    is_distributed,
)

WORLD = 2
MODES = [
    dict(method="minmax"),
    dict(method="recall_window", ratio=0.99),
    dict(method="abs_quantile", ratio=0.97),
    dict(method="recall_window", ratio=0.99, accumulate="pooled", max_samples=20_000),
    dict(method="abs_quantile", ratio=0.9, accumulate="pooled", max_samples=20_000),
]


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(6):
        x = torch.randn(2, 3, 5 + i, 16, generator=g)
        x = x / torch.rand(x.shape, generator=g).clamp_min(0.02)  # heavy tails
        out.append(x.bfloat16() if i % 2 else x)
    return out


def model_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(2, 6, 32, generator=g) for _ in range(4)]


def observe(obs: PerHeadObserver, xs: list[torch.Tensor]) -> PerHeadObserver:
    for x in xs:
        obs.update(x)
    return obs


def calibrate_model(xs: list[torch.Tensor]):
    # The hand-written model and adapter of the processor tests.
    from test_fa3_processor import TinyAdapter, make_model

    model = make_model()
    cfg = FA3QuantConfig(fa_k={"accumulate": "pooled", "max_samples": 100_000})
    proc = FA3Processor(cfg)
    proc.preprocess(model, TinyAdapter())
    proc.process(model)
    with torch.no_grad():
        for x in xs:
            model(x)
    proc.postprocess(model)  # reduces across ranks when distributed is initialised
    return proc.export_scales(model)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    try:
        assert is_distributed()
        mine = batches()[rank::WORLD]  # each rank sees half of the batches
        results = []
        for kw in MODES:
            obs = observe(PerHeadObserver(3, **kw), mine)
            all_reduce_observer(obs)
            results.append((obs.range(), obs.num_samples))
        scales = calibrate_model(model_inputs()[rank::WORLD])
        torch.save(
            {"observers": results, "scales": scales},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_is_bit_equal(tmp_path):
    assert not is_distributed()
    # single process: all batches, and all_reduce_observer is a no-op
    single = []
    for kw in MODES:
        obs = observe(PerHeadObserver(3, **kw), batches())
        assert all_reduce_observer(obs) is obs
        single.append((obs.range(), obs.num_samples))
    single_scales = calibrate_model(model_inputs())

    mp.spawn(
        _worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True
    )
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for kw, ((lo, hi), n), ((s_lo, s_hi), s_n) in zip(
            MODES, got["observers"], single
        ):
            assert torch.equal(lo, s_lo) and torch.equal(hi, s_hi), (rank, kw)
            assert torch.equal(n, s_n)
        assert got["scales"].keys() == single_scales.keys()
        for name, branches in single_scales.items():
            for branch, (scale, offset) in branches.items():
                assert torch.equal(got["scales"][name][branch][0], scale), (
                    name,
                    branch,
                )
                assert torch.equal(got["scales"][name][branch][1], offset)
    # the halves really differ, so the reduction is what made them equal
    half = observe(PerHeadObserver(3, **MODES[1]), batches()[0::WORLD])
    assert not torch.equal(half.range()[1], single[1][0][1])


@pytest.mark.parametrize("kw", [MODES[0], MODES[3]])
def test_reduce_is_noop_without_process_group(kw):
    obs = observe(PerHeadObserver(3, **kw), batches()[:2])
    before = obs.state_dict()
    all_reduce_observer(obs)
    after = obs.state_dict()
    assert all(
        torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]
        for k, v in before.items()
    )


def _bad_worker(rank: int, init_file: str, case: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    try:
        if case == "mismatch":
            obs = PerHeadObserver(3, ratio=0.99 if rank == 0 else 0.9, name="l.fa_q")
        else:
            # each rank's half fits the bound, the total does not
            obs = PerHeadObserver(
                3, accumulate="pooled", max_samples=1000, name="l.fa_k"
            )
        obs.update(torch.randn(1, 3, 10, 64))
        all_reduce_observer(obs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("case", "match"),
    [
        (
            "mismatch",
            r"rank [01] reduces \('l.fa_q', \{.*'ratio': 0.9.*\}\) but rank [01] "
            r"reduces .* every rank must reduce the same observers",
        ),
        (
            "bound",
            r"observer 'l.fa_k' saw 1280 samples per head over 2 ranks, more "
            r"than max_samples=1000",
        ),
    ],
)
def test_distributed_errors(tmp_path, case, match):
    with pytest.raises(mp.ProcessRaisedException, match=match):
        mp.spawn(
            _bad_worker, args=(str(tmp_path / "store"), case), nprocs=WORLD, join=True
        )
