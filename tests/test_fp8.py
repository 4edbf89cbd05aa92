"""DeepSeek FP8 block-scale conversion: kernels against naive references, checkpoint
conversion through the CLI, resume after interruption, and every bad input."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from ascend_fa import fp8
from ascend_fa.cli import main
from ascend_fa.fp8 import (
    FP8ConversionError,
    blocks,
    dequantize_blockwise,
    dequantize_checkpoint,
    plan_workers,
    quantize_blockwise,
    quantize_checkpoint,
    read_safetensors_header,
)

TINY = torch.finfo(torch.float32).tiny
FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------
# Naive references: one Python iteration per block, written straight from the spec.
# --------------------------------------------------------------------------------------


def naive_quantize(w: torch.Tensor, block=(128, 128)):
    br, bc = block
    out, cols = w.shape
    q = torch.empty((out, cols), dtype=FP8)
    s = torch.empty((math.ceil(out / br), math.ceil(cols / bc)))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            amax = blk.abs().amax()
            sc = torch.maximum(amax / 448.0, torch.tensor(TINY))
            s[i, j] = sc
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (blk / sc).to(FP8)
    return q, s


def naive_dequantize(q: torch.Tensor, s: torch.Tensor, dtype, block=(128, 128)):
    br, bc = block
    w = torch.empty(q.shape, dtype=dtype)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = q[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            w[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (blk * s[i, j]).to(dtype)
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    )


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


# --------------------------------------------------------------------------------------
# Synthetic DeepSeek-like checkpoints
# --------------------------------------------------------------------------------------

# Shapes are deliberately not multiples of 128 (partial edge blocks in both dims).
H, I, E = 300, 400, 130


def _layer(i: int, moe: bool) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_a_proj.weight": (200, H),
        p + "self_attn.q_a_layernorm.weight": (200,),
        p + "self_attn.q_b_proj.weight": (260, 200),
        p + "self_attn.kv_a_proj_with_mqa.weight": (136, H),
        p + "self_attn.kv_a_layernorm.weight": (72,),
        p + "self_attn.kv_b_proj.weight": (300, 72),
        p + "self_attn.o_proj.weight": (H, 260),
    }
    if moe:
        t[p + "mlp.gate.weight"] = (4, H)
        for e in range(2):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = (E, H)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = (E, H)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = (H, E)
        t[p + "mlp.shared_experts.down_proj.weight"] = (H, E)
    else:
        t[p + "mlp.gate_proj.weight"] = (I, H)
        t[p + "mlp.up_proj.weight"] = (I, H)
        t[p + "mlp.down_proj.weight"] = (H, I)
    return t


SHARDS = {
    "model-00001-of-00003.safetensors": {
        "model.embed_tokens.weight": (500, H),
        **_layer(0, moe=False),
    },
    "model-00002-of-00003.safetensors": _layer(1, moe=True),
    "model-00003-of-00003.safetensors": {
        "model.norm.weight": (H,),
        "lm_head.weight": (500, H),
    },
}
ALL_SHAPES = {n: s for shard in SHARDS.values() for n, s in shard.items()}
DEFAULT_SELECTED = sorted(
    n for n in ALL_SHAPES if n.endswith("_proj.weight") or n.endswith("_mqa.weight")
)
OTHER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": '{"bos_token": "<s>"}',
    "generation_config.json": '{"do_sample": true}',
    "configuration_deepseek.py": "class DeepseekV3Config:\n    pass\n",
    "inference/README.md": "nested files are copied too\n",
}
BASE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": H,
    "torch_dtype": "bfloat16",
    "model_type": "deepseek_v3",
}


def _weights(shape, gen) -> torch.Tensor:
    # Rows at very different magnitudes, one all-zero block row, heavy-ish tails.
    w = torch.randn(shape, generator=gen)
    if len(shape) == 2:
        w = w * torch.logspace(-3, 1, shape[0])[:, None]
        if shape[0] > 128:
            w[:128, :128] = 0
    return w.to(torch.bfloat16)


def _write_checkpoint(
    root: Path,
    shards: dict[str, dict[str, torch.Tensor]],
    config: dict | None,
    index: bool = True,
) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        save_file(tensors, str(root / name), metadata={"format": "pt"})
    if index:
        wm = {t: s for s, ts in shards.items() for t in ts}
        total = sum(
            v.numel() * v.element_size() for ts in shards.values() for v in ts.values()
        )
        (root / "model.safetensors.index.json").write_text(
            json.dumps(
                {
                    "metadata": {"total_size": total},
                    "weight_map": dict(sorted(wm.items())),
                },
                indent=2,
            )
        )
    if config is not None:
        (root / "config.json").write_text(json.dumps(config, indent=2))
    for rel, text in OTHER_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def make_bf16_checkpoint(root: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shards = {
        s: {n: _weights(shape, gen) for n, shape in ts.items()}
        for s, ts in SHARDS.items()
    }
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    shards["model-00002-of-00003.safetensors"][bias] = torch.rand(4, generator=gen)
    _write_checkpoint(root, shards, BASE_CONFIG)
    return {n: t for ts in shards.values() for n, t in ts.items()}


def _exact_scales(shape, gen) -> torch.Tensor:
    # <= 4 significant bits: code (4 bits) x scale fits bf16's 8-bit significand, so
    # dequantization to bf16 is exact (see test_official_fp8_roundtrip_exact).
    m = torch.randint(8, 16, shape, generator=gen).float() / 8
    e = torch.randint(-14, -6, shape, generator=gen).float()
    return m * torch.exp2(e)


def _random_codes(shape, scale_shape, gen, block=(128, 128)) -> torch.Tensor:
    u = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    u[(u & 0x7F) == 0x7F] = 0x00  # no NaN codes
    # Every block holds a +-448 code, as real quantization output does (its amax).
    for i in range(scale_shape[0]):
        for j in range(scale_shape[1]):
            u[i * block[0], j * block[1]] = 0x7E | (0x80 if (i + j) % 2 else 0)
    return u.view(FP8)


def make_fp8_checkpoint(
    root: Path, seed: int = 1, exact_scales: bool = True, block=(128, 128)
) -> dict[str, torch.Tensor]:
    """An "official" DeepSeek FP8 checkpoint: default-selected weights FP8 with
    scales, everything else bf16, quantization_config in config.json."""
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for s, ts in SHARDS.items():
        shards[s] = {}
        for n, shape in ts.items():
            if n in DEFAULT_SELECTED:
                sshape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
                shards[s][n] = _random_codes(shape, sshape, gen, block)
                shards[s][n + "_scale_inv"] = (
                    _exact_scales(sshape, gen)
                    if exact_scales
                    else torch.rand(sshape, generator=gen) * 1e-3 + 1e-5
                )
            else:
                shards[s][n] = _weights(shape, gen)
    config = dict(
        BASE_CONFIG,
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
            "ignored_layers": list(fp8.DEFAULT_IGNORE),
        },
    )
    _write_checkpoint(root, shards, config)
    return {n: t for ts in shards.values() for n, t in ts.items()}


def load_dir(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out[f.name] = {k: h.get_tensor(k) for k in h.keys()}
    return out


def flat(root: Path) -> dict[str, torch.Tensor]:
    return {n: t for ts in load_dir(root).values() for n, t in ts.items()}


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------------------
# One tensor
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(300, 200), (129, 1), (1, 1), (256, 384), (2500, 130)]
)
def test_quantize_blockwise_bit_equal_to_naive(shape, dtype):
    gen = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    w = torch.randn(shape, generator=gen) * torch.logspace(-20, 2, shape[0])[:, None]
    w[: min(shape[0], 40)] = 0  # an all-zero block (scale floor, never NaN)
    w = w.to(dtype)
    q, s = quantize_blockwise(w)
    qr, sr = naive_quantize(w)
    assert_bit_equal(q, qr)
    assert_bit_equal(s, sr)
    assert not torch.isnan(q.float()).any()
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))


def test_quantize_blockwise_other_block_size_and_chunks(monkeypatch):
    # Small chunks force many chunks per tensor, including a partial last one.
    monkeypatch.setattr(blocks, "CHUNK_ELEMS", 64 * 100)
    monkeypatch.setattr(blocks, "NATIVE_CHUNK_ELEMS", 64 * 100)
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(333, 100, generator=gen) * 5).to(torch.bfloat16)
    q, s = quantize_blockwise(w, (64, 48))
    qr, sr = naive_quantize(w, (64, 48))
    assert_bit_equal(q, qr)
    assert_bit_equal(s, sr)
    d = dequantize_blockwise(q, s, torch.bfloat16, (64, 48))
    assert_bit_equal(d, naive_dequantize(q, s, torch.bfloat16, (64, 48)))


def test_quantize_scale_floor_for_tiny_block():
    w = torch.full((10, 10), 1e-45)  # amax / 448 underflows to 0 in fp32
    q, s = quantize_blockwise(w)
    assert s.item() == TINY
    assert torch.isfinite(q.float()).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_blockwise_nonfinite_names_block(bad):
    w = torch.zeros(300, 300, dtype=torch.bfloat16)
    w[130, 260] = bad
    with pytest.raises(
        FP8ConversionError, match=r"non-finite values in block \(1, 2\)"
    ):
        quantize_blockwise(w)


def test_dequantize_blockwise_every_code_bit_equal():
    u = torch.arange(256, dtype=torch.uint8)
    codes = u[(u & 0x7F) != 0x7F].view(FP8)  # all 254 non-NaN codes, +-0, subnormals
    q = codes.repeat(200)[: 130 * 300].view(130, 300)
    gen = torch.Generator().manual_seed(5)
    s = torch.rand(2, 3, generator=gen) * 1e-2
    s[0, 0] = TINY  # subnormal products
    for dtype in (torch.bfloat16, torch.float16):
        assert_bit_equal(
            dequantize_blockwise(q, s, dtype), naive_dequantize(q, s, dtype)
        )


def test_dequantize_blockwise_whole_blocks_bit_equal():
    """Whole 128x128 blocks (no edge padding), every code, subnormal products."""
    u = torch.arange(256, dtype=torch.uint8)
    codes = u[(u & 0x7F) != 0x7F].view(FP8)
    q = codes.repeat(800)[: 256 * 384].view(256, 384)
    gen = torch.Generator().manual_seed(6)
    s = torch.rand(2, 3, generator=gen) * 1e-2
    s[1, 2] = TINY
    for dtype in (torch.bfloat16, torch.float16):
        assert_bit_equal(
            dequantize_blockwise(q, s, dtype), naive_dequantize(q, s, dtype)
        )


def test_dequantize_blockwise_huge_scale_path():
    q = torch.tensor([[448.0, -0.5, 2.0**-9]]).to(FP8)
    s = torch.tensor([[2.0**125]])  # scale * 256 overflows: exact fallback path
    assert_bit_equal(
        dequantize_blockwise(q, s, torch.bfloat16),
        naive_dequantize(q, s, torch.bfloat16),
    )


def test_dequantize_blockwise_rejects_nan_codes_and_fp16_overflow():
    q = torch.zeros(200, 300, dtype=FP8)
    q.view(torch.uint8)[150, 140] = 0xFF
    with pytest.raises(FP8ConversionError, match=r"FP8 NaN code in block \(1, 1\)"):
        dequantize_blockwise(q, torch.ones(2, 3))
    q = torch.full((4, 4), 448.0).to(FP8)
    with pytest.raises(FP8ConversionError, match="beyond float16 in block"):
        dequantize_blockwise(q, torch.full((1, 1), 1000.0), torch.float16)
    with pytest.raises(FP8ConversionError, match="scale_inv shape"):
        dequantize_blockwise(q, torch.ones(2, 1))
    s = torch.ones(2, 3)
    s[1, 2] = float("nan")
    with pytest.raises(
        FP8ConversionError, match=r"non-finite scale_inv in block \(1, 2\)"
    ):
        dequantize_blockwise(torch.zeros(200, 300, dtype=FP8), s)


def test_roundtrip_error_within_e4m3_bound():
    """|dequantize(quantize(W)) - W| per element, in fp64, against the bound

    ``scale_inv * max(2**(floor(log2(|W| / scale_inv)) - 4), 2**-10) + 2**-8 |W|``:
    E4M3 has 3 mantissa bits, so in the binade [2**e, 2**(e+1)) of the scaled value
    its spacing is 2**(e-3) and round-to-nearest errs by at most half of it; below
    2**-6 (subnormals) the spacing is a fixed 2**-9. Scaling back by scale_inv is
    exact up to fp32 rounding, and the final cast to bf16 adds at most 2**-9 |W|
    (2**-8 leaves room for both).
    """
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(700, 333, generator=gen) * torch.logspace(-4, 2, 700)[:, None]).to(
        torch.bfloat16
    )
    q, s = quantize_blockwise(w)
    d = dequantize_blockwise(q, s).double()
    w64 = w.double()
    sf = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:700, :333]
    v = (w64 / sf).abs()
    step = torch.where(
        v >= 2.0**-6,
        torch.exp2(torch.floor(torch.log2(v)) - 4),
        torch.full_like(v, 2.0**-10),
    )
    bound = sf * step + 2.0**-8 * w64.abs()
    err = (d - w64).abs()
    assert (err <= bound).all()
    # The bound is tight: the worst element uses a good part of it.
    assert (err / bound).max() > 0.5
    # And per block, the error never exceeds half the largest spacing (16 * scale).
    assert (err <= 16 * sf + 2.0**-8 * w64.abs()).all()


# --------------------------------------------------------------------------------------
# Checkpoints through the CLI
# --------------------------------------------------------------------------------------


def _quantize_cli(inp: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "fp8",
            "quantize",
            "--input",
            str(inp),
            "--output",
            str(out),
            "--quiet",
            *extra,
        ]
    )


def _dequantize_cli(inp: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "fp8",
            "dequantize",
            "--input",
            str(inp),
            "--output",
            str(out),
            "--quiet",
            *extra,
        ]
    )


def test_quantize_checkpoint_cli(tmp_path):
    src = make_bf16_checkpoint(tmp_path / "bf16")
    out = tmp_path / "fp8"
    assert _quantize_cli(tmp_path / "bf16", out) == 0
    assert not (tmp_path / "fp8.partial").exists()
    shards = load_dir(out)
    assert sorted(shards) == sorted(SHARDS)  # same shard layout
    got = {n: t for ts in shards.values() for n, t in ts.items()}
    quantized = sorted(n for n, t in got.items() if t.dtype == FP8)
    assert quantized == DEFAULT_SELECTED
    assert "model.layers.1.mlp.gate.weight" not in quantized  # router stays bf16
    for name, w in src.items():
        if name in DEFAULT_SELECTED:
            qr, sr = naive_quantize(w)
            assert_bit_equal(got[name], qr)
            assert_bit_equal(got[name + "_scale_inv"], sr)
        else:
            assert_bit_equal(got[name], w)
    assert set(got) == set(src) | {n + "_scale_inv" for n in DEFAULT_SELECTED}
    # every scale is in the same shard as its weight
    for s, ts in shards.items():
        for n in ts:
            if n.endswith("_scale_inv"):
                assert n[: -len("_scale_inv")] in ts, (s, n)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: s for s, ts in shards.items() for n in ts}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in got.values()
    )
    config = json.loads((out / "config.json").read_text())
    assert config == dict(
        BASE_CONFIG,
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            # module names of the 2-D weights kept in BF16 (what vLLM matches)
            "ignored_layers": [
                "lm_head",
                "model.embed_tokens",
                "model.layers.1.mlp.gate",
            ],
        },
    )
    for rel, text in OTHER_FILES.items():
        assert (out / rel).read_text() == text
    # the input's safetensors metadata is kept
    first = out / "model-00001-of-00003.safetensors"
    assert read_safetensors_header(first).metadata == {"format": "pt"}


def test_streaming_in_one_block_row_chunks_matches_naive(tmp_path, monkeypatch):
    """Every tensor streamed one block row at a time (file offsets per chunk, the
    partial last block row, scales assembled across chunks)."""
    monkeypatch.setattr(blocks, "CHUNK_ELEMS", 1)
    monkeypatch.setattr(blocks, "NATIVE_CHUNK_ELEMS", 1)
    src = make_bf16_checkpoint(tmp_path / "bf16")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "fp8") == 0
    got = flat(tmp_path / "fp8")
    for name in DEFAULT_SELECTED:
        qr, sr = naive_quantize(src[name])
        assert_bit_equal(got[name], qr)
        assert_bit_equal(got[name + "_scale_inv"], sr)
    assert _dequantize_cli(tmp_path / "fp8", tmp_path / "deq") == 0
    deq = flat(tmp_path / "deq")
    for name in DEFAULT_SELECTED:
        ref = naive_dequantize(got[name], got[name + "_scale_inv"], torch.bfloat16)
        assert_bit_equal(deq[name], ref)


def test_dequantize_checkpoint_cli(tmp_path, caplog):
    src = make_fp8_checkpoint(tmp_path / "fp8")
    for dtype, tdt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        out = tmp_path / f"deq-{dtype}"
        with caplog.at_level(logging.WARNING, logger="ascend_fa.fp8"):
            assert _dequantize_cli(tmp_path / "fp8", out, "--dtype", dtype) == 0
        assert "passed through unchanged" in caplog.text
        got = flat(out)
        assert not any(n.endswith("_scale_inv") for n in got)
        for name, t in src.items():
            if name.endswith("_scale_inv"):
                continue
            if name in DEFAULT_SELECTED:
                ref = naive_dequantize(t, src[name + "_scale_inv"], tdt)
                assert_bit_equal(got[name], ref)
            else:
                assert_bit_equal(got[name], t)
        config = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in config
        assert config["torch_dtype"] == dtype
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(got)
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in got.values()
        )
        assert (out / "tokenizer.json").read_text() == OTHER_FILES["tokenizer.json"]


def test_official_fp8_roundtrip_exact(tmp_path):
    """dequantize then quantize (selection from the official index) reproduces the
    official checkpoint bit for bit. Why: every block holds a +-448 code, so the
    dequantized block's amax is 448 * scale_inv exactly (the scales have <= 4
    significant bits, so code * scale_inv is exact in bf16); requantizing gives
    scale_inv' = (448 * scale_inv) / 448 = scale_inv exactly, and W / scale_inv' =
    code exactly."""
    official = make_fp8_checkpoint(tmp_path / "official")
    assert _dequantize_cli(tmp_path / "official", tmp_path / "bf16") == 0
    assert (
        _quantize_cli(
            tmp_path / "bf16",
            tmp_path / "re",
            "--reference-fp8",
            str(tmp_path / "official"),
        )
        == 0
    )
    again = load_dir(tmp_path / "re")
    ref = load_dir(tmp_path / "official")
    assert sorted(again) == sorted(ref)
    for shard, ts in ref.items():
        assert sorted(again[shard]) == sorted(ts)
        for n, t in ts.items():
            assert_bit_equal(again[shard][n], t)
    assert set(again) and official
    cfg_re = json.loads((tmp_path / "re" / "config.json").read_text())
    cfg_off = json.loads((tmp_path / "official" / "config.json").read_text())
    assert cfg_re == cfg_off
    idx_re = json.loads((tmp_path / "re" / "model.safetensors.index.json").read_text())
    idx_off = json.loads(
        (tmp_path / "official" / "model.safetensors.index.json").read_text()
    )
    assert idx_re == idx_off


def test_official_roundtrip_arbitrary_scales_codes_exact(tmp_path):
    """With arbitrary fp32 scales the bf16 rounding of code * scale_inv changes the
    block amax by < 2**-9 relative, so requantized scales differ by < 2**-8 relative
    -- far less than half an E4M3 spacing (>= 2**-5 relative) -- and every code is
    reproduced."""
    official = make_fp8_checkpoint(tmp_path / "official", exact_scales=False)
    assert _dequantize_cli(tmp_path / "official", tmp_path / "bf16") == 0
    assert (
        _quantize_cli(
            tmp_path / "bf16",
            tmp_path / "re",
            "--reference-fp8",
            str(tmp_path / "official"),
        )
        == 0
    )
    got = flat(tmp_path / "re")
    assert set(got) == set(official)
    for n, t in official.items():
        if n.endswith("_scale_inv"):
            rel = (got[n].double() / t.double() - 1).abs().max()
            assert rel < 2.0**-8
        else:
            assert_bit_equal(got[n], t)


def test_reference_fp8_selects_exactly_the_scaled_weights(tmp_path, caplog):
    make_bf16_checkpoint(tmp_path / "bf16")
    ref = tmp_path / "ref"
    ref.mkdir()
    chosen = [
        "model.layers.1.mlp.gate.weight",  # not selected by default
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.61.eh_proj.weight",
    ]  # absent from the input: warned
    wm = {n: "x.safetensors" for n in chosen}
    wm.update({n + "_scale_inv": "x.safetensors" for n in chosen})
    wm["lm_head.weight"] = "x.safetensors"
    (ref / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    (ref / "config.json").write_text(
        json.dumps(
            {
                "quantization_config": {
                    "weight_block_size": [128, 128],
                    "ignored_layers": ["lm_head"],
                }
            }
        )
    )
    with caplog.at_level(logging.WARNING, logger="ascend_fa.fp8"):
        assert (
            _quantize_cli(
                tmp_path / "bf16", tmp_path / "out", "--reference-fp8", str(ref)
            )
            == 0
        )
    assert "not in the input (e.g. model.layers.61.eh_proj.weight)" in caplog.text
    got = flat(tmp_path / "out")
    assert sorted(n for n, t in got.items() if t.dtype == FP8) == sorted(chosen[:2])
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["ignored_layers"] == ["lm_head"]
    # reference given as the index file itself works too
    assert (
        _quantize_cli(
            tmp_path / "bf16",
            tmp_path / "out2",
            "--reference-fp8",
            str(ref / "model.safetensors.index.json"),
        )
        == 0
    )
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "out2")


def test_reference_fp8_bad_inputs(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    ref = tmp_path / "ref"
    ref.mkdir()
    with pytest.raises(FileNotFoundError, match="reference-fp8.*index.json not found"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "o", reference_fp8=ref)
    (ref / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "x"}})
    )
    with pytest.raises(FP8ConversionError, match="no \\*_scale_inv tensors"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "o", reference_fp8=ref)
    (ref / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight_scale_inv": "x"}})
    )
    with pytest.raises(FP8ConversionError, match="'model.norm.weight'.*not a 2-D"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "o", reference_fp8=ref)
    with pytest.raises(FP8ConversionError, match="cannot be combined"):
        quantize_checkpoint(
            tmp_path / "bf16", tmp_path / "o", reference_fp8=ref, include=["proj"]
        )
    (ref / "config.json").write_text(
        json.dumps({"quantization_config": {"weight_block_size": [64, 64]}})
    )
    with pytest.raises(FP8ConversionError, match=r"weight_block_size \[64, 64\]"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "o", reference_fp8=ref)


def test_include_ignore_rules(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    assert (
        _quantize_cli(
            tmp_path / "bf16",
            tmp_path / "out",
            "--include",
            r"experts\.",
            "mlp\\.gate\\.weight$",
            "--ignore",
            "down_proj",
            "--block-size",
            "64",
            "32",
        )
        == 0
    )
    got = flat(tmp_path / "out")
    expect = sorted(
        n
        for n in ALL_SHAPES
        if (".experts." in n and "down_proj" not in n) or n.endswith("mlp.gate.weight")
    )
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" not in expect
    assert sorted(n for n, t in got.items() if t.dtype == FP8) == expect
    n = expect[0]
    assert got[n + "_scale_inv"].shape == (
        math.ceil(ALL_SHAPES[n][0] / 64),
        math.ceil(ALL_SHAPES[n][1] / 32),
    )
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    kept = sorted(
        n[: -len(".weight")]
        for n, shape in ALL_SHAPES.items()
        if len(shape) == 2 and n not in expect
    )
    assert "model.layers.1.mlp.experts.0.down_proj" in kept
    assert cfg["quantization_config"]["ignored_layers"] == kept
    assert cfg["quantization_config"]["weight_block_size"] == [64, 32]
    # dequantize reads the block size back from the config
    assert _dequantize_cli(tmp_path / "out", tmp_path / "deq") == 0
    assert flat(tmp_path / "deq")[n].dtype == torch.bfloat16


def test_select_for_quantization_uses_search_semantics():
    entries = [fp8.TensorEntry(n, "BF16", s, 0, 0) for n, s in ALL_SHAPES.items()]
    picked = fp8.select_for_quantization(entries)
    assert picked == DEFAULT_SELECTED
    # unanchored: 'lm_head' ignores lm_head.weight; '^lm_head$' would not
    assert "lm_head.weight" in fp8.select_for_quantization(entries, ["weight"], [])
    assert "lm_head.weight" not in fp8.select_for_quantization(
        entries, ["weight"], ["lm_head"]
    )
    assert "lm_head.weight" in fp8.select_for_quantization(
        entries, ["weight"], ["^lm_head$"]
    )
    with pytest.raises(FP8ConversionError, match="invalid --include regex"):
        fp8.select_for_quantization(entries, ["("], [])


def test_single_file_checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(2)
    tensors = {
        "model.layers.0.self_attn.o_proj.weight": _weights((260, 140), gen),
        "lm_head.weight": _weights((50, 140), gen),
    }
    _write_checkpoint(
        tmp_path / "in", {"model.safetensors": tensors}, BASE_CONFIG, index=False
    )
    assert _quantize_cli(tmp_path / "in", tmp_path / "out") == 0
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    got = flat(tmp_path / "out")
    qr, sr = naive_quantize(tensors["model.layers.0.self_attn.o_proj.weight"])
    assert_bit_equal(got["model.layers.0.self_attn.o_proj.weight"], qr)
    assert_bit_equal(got["model.layers.0.self_attn.o_proj.weight_scale_inv"], sr)
    assert _dequantize_cli(tmp_path / "out", tmp_path / "deq") == 0
    assert sorted(flat(tmp_path / "deq")) == sorted(tensors)


def test_nonfinite_weight_names_tensor_and_block(tmp_path, capsys):
    make_bf16_checkpoint(tmp_path / "bf16")
    shard = tmp_path / "bf16" / "model-00002-of-00003.safetensors"
    with safe_open(str(shard), framework="pt") as h:
        ts = {k: h.get_tensor(k) for k in h.keys()}
    ts["model.layers.1.self_attn.o_proj.weight"][200, 140] = float("nan")
    save_file(ts, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        FP8ConversionError,
        match=r"model-00002-of-00003\.safetensors: tensor "
        r"'model\.layers\.1\.self_attn\.o_proj\.weight' has non-finite "
        r"values in block \(1, 1\)",
    ):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "out2") == 2
    assert "non-finite values in block (1, 1)" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# Interruption and resume
# --------------------------------------------------------------------------------------


def stop_after(n: int, exc: type[BaseException] = KeyboardInterrupt):
    """An ``on_shard_done`` hook that interrupts the conversion after ``n`` shards
    were recorded, as Ctrl-C (or a SIGTERM handler's SystemExit) would."""
    seen: list[str] = []

    def hook(name: str) -> None:
        seen.append(name)
        if len(seen) >= n:
            raise exc()

    return hook


def interrupted(verb, inp: Path, out: Path, n: int = 1, **kw) -> None:
    with pytest.raises(KeyboardInterrupt):
        verb(inp, out, progress=False, on_shard_done=stop_after(n), **kw)
    assert not out.exists()
    assert not list(partial_of(out).glob("*.tmp"))  # temp files removed


def partial_of(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def test_interrupt_then_resume_is_byte_identical(tmp_path, caplog):
    make_bf16_checkpoint(tmp_path / "bf16")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "clean") == 0
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    interrupted(quantize_checkpoint, tmp_path / "bf16", out)
    manifest = json.loads((partial / fp8.MANIFEST_NAME).read_text())
    assert list(manifest["done"]) == ["model-00001-of-00003.safetensors"]
    assert manifest["complete"] is False
    rec = manifest["done"]["model-00001-of-00003.safetensors"]
    shard = (partial / "model-00001-of-00003.safetensors").read_bytes()
    assert rec == {"size": len(shard), "xxh3_128": xxhash.xxh3_128(shard).hexdigest()}
    # a shard half-written when the process died
    (partial / "model-00002-of-00003.safetensors.tmp").write_bytes(b"\0" * 100)
    with caplog.at_level(logging.INFO, logger="ascend_fa.fp8"):
        assert _quantize_cli(tmp_path / "bf16", out) == 0
    assert "1 of 3 shards already done" in caplog.text
    assert not partial.exists()
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")
    final = json.loads((out / fp8.MANIFEST_NAME).read_text())
    assert final["complete"] is True and len(final["done"]) == 3


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_keeps_resume_state_and_cleans_temp_files(tmp_path, exc):
    """Ctrl-C (KeyboardInterrupt) and SIGTERM through a handler that raises
    SystemExit: the exception propagates, no temp file is left, the manifest is
    valid JSON listing exactly the finished shards, and the rerun resumes."""
    make_fp8_checkpoint(tmp_path / "fp8")
    assert _dequantize_cli(tmp_path / "fp8", tmp_path / "clean") == 0
    out = tmp_path / "out"
    with pytest.raises(exc):
        dequantize_checkpoint(
            tmp_path / "fp8", out, progress=False, on_shard_done=stop_after(2, exc)
        )
    partial = partial_of(out)
    names = sorted(p.name for p in partial.iterdir())
    manifest = json.loads((partial / fp8.MANIFEST_NAME).read_text())
    assert sorted(manifest["done"]) == [n for n in names if n.endswith("tensors")]
    assert len(manifest["done"]) == 2 and not any(n.endswith(".tmp") for n in names)
    result = dequantize_checkpoint(tmp_path / "fp8", out, progress=False)
    assert len(result.resumed) == 2
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


def test_resume_redoes_a_tampered_shard(tmp_path, caplog):
    make_fp8_checkpoint(tmp_path / "fp8")
    assert _dequantize_cli(tmp_path / "fp8", tmp_path / "clean") == 0
    interrupted(dequantize_checkpoint, tmp_path / "fp8", tmp_path / "out", 2)
    victim = tmp_path / "out.partial" / "model-00001-of-00003.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="ascend_fa.fp8"):
        assert _dequantize_cli(tmp_path / "fp8", tmp_path / "out") == 0
    assert "failed verification" in caplog.text
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


def _as_first_format(partial: Path) -> None:
    """Rewrite the manifest as the first manifest format had it: sha256 records."""
    path = partial / fp8.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["format"] = "ascend-fa-fp8-manifest/1"
    manifest["done"] = {
        name: {
            "size": rec["size"],
            "sha256": hashlib.sha256((partial / name).read_bytes()).hexdigest(),
        }
        for name, rec in manifest["done"].items()
    }
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("flip", [False, True])
def test_resume_from_a_sha256_manifest(tmp_path, caplog, flip):
    """A conversion interrupted under the first manifest format (sha256 records)
    still resumes: its shards are verified by sha256 (a flipped byte is found and
    the shard converted again), and the finished output, manifest included, is
    byte-identical to a clean run's (records rewritten as xxh3-128)."""
    make_bf16_checkpoint(tmp_path / "bf16")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "clean") == 0
    out = tmp_path / "out"
    interrupted(quantize_checkpoint, tmp_path / "bf16", out)
    _as_first_format(partial_of(out))
    if flip:
        victim = partial_of(out) / "model-00001-of-00003.safetensors"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="ascend_fa.fp8"):
        assert _quantize_cli(tmp_path / "bf16", out) == 0
    assert ("failed verification" in caplog.text) == flip
    assert ("1 of 3 shards already done" in caplog.text) != flip
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")
    final = json.loads((out / fp8.MANIFEST_NAME).read_text())
    assert final["format"] == "ascend-fa-fp8-manifest/2"
    for name, rec in final["done"].items():
        assert rec["xxh3_128"] == xxhash.xxh3_128((out / name).read_bytes()).hexdigest()


def test_resume_with_different_parameters_is_refused(tmp_path, capsys):
    make_bf16_checkpoint(tmp_path / "bf16")
    interrupted(quantize_checkpoint, tmp_path / "bf16", tmp_path / "out")
    with pytest.raises(
        FP8ConversionError, match=r"different parameters \(block_size\)"
    ):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out", block_size=(64, 64))
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "out", "--ignore", "x") == 2
    assert "different parameters (ignore, ignored_layers)" in capsys.readouterr().err
    # --overwrite discards the interrupted run and starts over
    assert (
        _quantize_cli(
            tmp_path / "bf16",
            tmp_path / "out",
            "--block-size",
            "64",
            "64",
            "--overwrite",
        )
        == 0
    )
    assert flat(tmp_path / "out")["lm_head.weight"].dtype == torch.bfloat16


def test_resume_refused_when_input_changed(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    interrupted(quantize_checkpoint, tmp_path / "bf16", tmp_path / "out")
    make_bf16_checkpoint(tmp_path / "bf16", seed=9)  # same names/shapes, new data
    with pytest.raises(FP8ConversionError, match="input shards changed"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out", progress=False)


def test_partial_dir_without_manifest_is_refused(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "stray").write_text("x")
    with pytest.raises(FP8ConversionError, match="exists without a manifest"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out", progress=False)


# --------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------


def test_missing_input_dir(tmp_path, capsys):
    with pytest.raises(
        FileNotFoundError, match="input directory .*nope does not exist"
    ):
        quantize_checkpoint(tmp_path / "nope", tmp_path / "out")
    assert _dequantize_cli(tmp_path / "nope", tmp_path / "out") == 2
    assert "does not exist" in capsys.readouterr().err


def test_input_is_a_file_and_bad_block_size(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileNotFoundError, match="input directory .*f is not a dir"):
        quantize_checkpoint(tmp_path / "f", tmp_path / "out")
    make_bf16_checkpoint(tmp_path / "bf16")
    with pytest.raises(
        FP8ConversionError,
        match=r"block size must be two positive integers, got \[0, 128",
    ):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out", block_size=(0, 128))


def test_no_safetensors(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "config.json").write_text("{}")
    with pytest.raises(FP8ConversionError, match=r"no \*\.safetensors files in"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out")


def test_index_lists_missing_shard(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    (tmp_path / "bf16" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        FP8ConversionError,
        match="lists shard model-00002-of-00003.safetensors, which is missing",
    ):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out")


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            "truncate",
            r"model-00002-of-00003\.safetensors: corrupt or truncated .*data "
            r"ends",
        ),
        (
            "tiny",
            r"model-00002-of-00003\.safetensors: corrupt or truncated .*no header",
        ),
        (
            "header-len",
            r"model-00002-of-00003\.safetensors: corrupt or truncated .*header "
            r"length",
        ),
        ("json", r"model-00002-of-00003\.safetensors: corrupt safetensors header"),
        (
            "offsets",
            r"model-00002-of-00003\.safetensors: corrupt safetensors file: tensor",
        ),
    ],
)
def test_corrupt_input_shard_names_the_file(tmp_path, damage, message, capsys):
    make_bf16_checkpoint(tmp_path / "bf16")
    shard = tmp_path / "bf16" / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if damage == "truncate":
        data = data[:-1000]
    elif damage == "tiny":
        data = data[:5]
    elif damage == "header-len":
        data = (10**9).to_bytes(8, "little") + data[8:]
    elif damage == "json":
        data = data[:8] + b"{" * n + data[8 + n :]
    else:
        header = json.loads(data[8 : 8 + n])
        key = next(k for k in header if k != "__metadata__")
        header[key]["data_offsets"][1] += 2
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (n - len(raw))
        assert len(raw) == n
        data = data[:8] + raw + data[8 + n :]
    shard.write_bytes(data)
    with pytest.raises(FP8ConversionError, match=message):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out")
    assert _dequantize_cli(tmp_path / "bf16", tmp_path / "out") == 2
    assert "model-00002-of-00003.safetensors" in capsys.readouterr().err


def test_existing_output_refused_untouched_unless_overwrite(tmp_path, capsys):
    make_bf16_checkpoint(tmp_path / "bf16")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert _quantize_cli(tmp_path / "bf16", out) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert tree_bytes(out) == {"keep.txt": b"precious"}
    with pytest.raises(FileExistsError, match="already exists"):
        quantize_checkpoint(tmp_path / "bf16", out)
    # not an output of ours: --overwrite alone is refused, --force is needed too
    assert _quantize_cli(tmp_path / "bf16", out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "not an ascend-fa FP8 conversion output" in err
    assert "--overwrite --force" in err and len(err.strip().splitlines()) == 1
    assert tree_bytes(out) == {"keep.txt": b"precious"}
    assert _quantize_cli(tmp_path / "bf16", out, "--overwrite", "--force") == 0
    assert not (out / "keep.txt").exists()
    assert (out / "model.safetensors.index.json").is_file()
    # an output of ours (it keeps the manifest) is replaced with --overwrite alone
    assert _quantize_cli(tmp_path / "bf16", out, "--overwrite") == 0
    # an empty directory is not a completed output
    (tmp_path / "empty").mkdir()
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "empty") == 0
    # a plain file in the way is refused too, and replaced with --overwrite --force
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="file already exists"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "file")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "file", "--overwrite") == 2
    args = ("--overwrite", "--force")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "file", *args) == 0
    assert tree_bytes(tmp_path / "file") == tree_bytes(out)


def test_output_inside_input_refused(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    with pytest.raises(FP8ConversionError, match="must not be, contain or lie inside"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "bf16" / "out")


def test_quantize_refuses_quantized_input(tmp_path):
    make_fp8_checkpoint(tmp_path / "fp8")
    with pytest.raises(FP8ConversionError, match="already has a quantization_config"):
        quantize_checkpoint(tmp_path / "fp8", tmp_path / "out")
    (tmp_path / "fp8" / "config.json").unlink()
    with pytest.raises(
        FP8ConversionError, match="already has 'model.*_scale_inv'; is it already quant"
    ):
        quantize_checkpoint(tmp_path / "fp8", tmp_path / "out")


def test_dequantize_missing_scale(tmp_path, caplog):
    src = make_fp8_checkpoint(tmp_path / "fp8")
    shard = tmp_path / "fp8" / "model-00003-of-00003.safetensors"
    with safe_open(str(shard), framework="pt") as h:
        ts = {k: h.get_tensor(k) for k in h.keys()}
    ts["model.extra.weight"] = torch.zeros(4, 4, dtype=FP8)
    ts["model.extra.int8"] = torch.ones(4, 4, dtype=torch.int8)
    save_file(ts, str(shard), metadata={"format": "pt"})
    idx_path = tmp_path / "fp8" / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"]["model.extra.weight"] = shard.name
    idx["weight_map"]["model.extra.int8"] = shard.name
    idx_path.write_text(json.dumps(idx))
    with pytest.raises(
        FP8ConversionError,
        match=r"'model\.extra\.int8' \(I8\) has no "
        r"'model\.extra\.int8_scale_inv'.*--allow-missing-scale",
    ):
        dequantize_checkpoint(tmp_path / "fp8", tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="ascend_fa.fp8"):
        assert (
            _dequantize_cli(tmp_path / "fp8", tmp_path / "out", "--allow-missing-scale")
            == 0
        )
    assert "model.extra.weight" in caplog.text or "passed through" in caplog.text
    got = flat(tmp_path / "out")
    assert_bit_equal(got["model.extra.weight"], ts["model.extra.weight"])
    assert_bit_equal(got["model.extra.int8"], ts["model.extra.int8"])
    assert got["lm_head.weight"].dtype == torch.bfloat16 and src


def test_dequantize_bad_inputs(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    with pytest.raises(FP8ConversionError, match="not a DeepSeek FP8 block-scale"):
        dequantize_checkpoint(tmp_path / "bf16", tmp_path / "out")
    with pytest.raises(FP8ConversionError, match="--dtype must be one of"):
        dequantize_checkpoint(tmp_path / "bf16", tmp_path / "out", dtype="float32")
    make_fp8_checkpoint(tmp_path / "fp8", block=(64, 64))
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        FP8ConversionError,
        match=r"_scale_inv' is F32 \[\d+, \d+\]; expected a float "
        r"tensor \[\d+, \d+\] .* with block \[128, 128\]",
    ):
        dequantize_checkpoint(tmp_path / "fp8", tmp_path / "out")


def test_plan_workers_memory_rule():
    gib = 1 << 30
    assert plan_workers(8, 3, available=64 * gib) == min(3, os.cpu_count() or 1)
    assert plan_workers(8, 100, available=1 * gib) == 1  # half of 1 GiB: one worker
    with pytest.raises(FP8ConversionError, match="--workers must be >= 1"):
        plan_workers(0, 3)


def test_help_documents_regex_semantics(capsys):
    with pytest.raises(SystemExit):
        main(["fp8", "quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "re.search" in text and "OUTPUT.partial/" in text


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")


def _cmd(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ascend_fa",
        *_args(tmp_path, *extra),
    ]


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "fp8",
        "quantize",
        "--input",
        str(tmp_path / "bf16"),
        "--output",
        str(tmp_path / "out"),
        *extra,
    ]


# The real CLI in a child process; the test (not the package) makes the writer of
# the second shard pause before it renames its file into place, so the signal lands
# at a known point: shard 1 finished and recorded, shard 2 fully written to its
# temporary file. With "term" the child handles SIGTERM by raising SystemExit(143),
# as a CLI-wide signal handler does.
_PAUSING_CHILD = r"""
import signal, sys, time
from ascend_fa.fp8 import convert

class PausingWriter(convert.ShardWriter):
    closed = 0

    def close(self):
        PausingWriter.closed += 1
        if PausingWriter.closed == 2:
            print("PAUSED", flush=True)
            time.sleep(600)
        return super().close()

convert.ShardWriter = PausingWriter
if sys.argv[1] == "term":
    def on_term(signum, frame):
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, on_term)
from ascend_fa.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _start_paused(tmp_path: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PAUSING_CHILD, mode, *_args(tmp_path, "--quiet")],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "PAUSED":
        proc.kill()
        pytest.fail(f"child did not pause: {line!r} {proc.communicate()[1]}")
    return proc


def test_subprocess_sigkill_after_first_shard_then_resumed(tmp_path, caplog):
    """The real command killed with SIGKILL (no cleanup possible) once the first
    shard is recorded in the manifest and the second is written but not renamed;
    the rerun resumes from the manifest and is byte-identical to a clean run."""
    make_bf16_checkpoint(tmp_path / "bf16")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "clean") == 0
    proc = _start_paused(tmp_path, "kill")
    partial = tmp_path / "out.partial"
    manifest = json.loads((partial / fp8.MANIFEST_NAME).read_text())
    assert list(manifest["done"]) == ["model-00001-of-00003.safetensors"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (partial / "model-00002-of-00003.safetensors.tmp").is_file()
    assert not (tmp_path / "out").exists()
    with caplog.at_level(logging.INFO, logger="ascend_fa.fp8"):
        assert _quantize_cli(tmp_path / "bf16", tmp_path / "out") == 0
    assert "1 of 3 shards already done" in caplog.text
    assert not partial.exists()
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_subprocess_signal_removes_temp_files_keeps_resume_state(tmp_path, sig):
    make_bf16_checkpoint(tmp_path / "bf16")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "clean") == 0
    proc = _start_paused(tmp_path, "term" if sig == "SIGTERM" else "int")
    os.kill(proc.pid, getattr(signal, sig))
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    if sig == "SIGTERM":
        assert proc.returncode == 143
    partial = tmp_path / "out.partial"
    assert sorted(p.name for p in partial.iterdir()) == [
        fp8.MANIFEST_NAME,
        "model-00001-of-00003.safetensors",
    ]
    manifest = json.loads((partial / fp8.MANIFEST_NAME).read_text())
    assert list(manifest["done"]) == ["model-00001-of-00003.safetensors"]
    rerun = subprocess.run(
        _cmd(tmp_path, "--quiet"), env=_env(), capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "1 shard(s) resumed" in rerun.stdout
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


@pytest.mark.slow  # spawns worker processes: ~15 s on 2 busy cores
def test_subprocess_workers_identical_and_refuses_existing(tmp_path):
    make_bf16_checkpoint(tmp_path / "bf16")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "clean") == 0
    done = subprocess.run(
        _cmd(tmp_path, "--workers", "2"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")
    again = subprocess.run(
        _cmd(tmp_path), env=_env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 2
    assert "already exists" in again.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


@pytest.mark.slow  # four child processes: ~10-20 s on 2 cores
def test_bench_fp8_quick_reports_every_op(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(["bench", "fp8", "--quick", "--json", str(out), "--tmpdir", str(tmp_path)])
        == 0
    )
    text = capsys.readouterr().out
    assert "| quantize" in text and "| dequantize" in text and "vs copy" in text
    doc = json.loads(out.read_text())
    res = {r["mode"]: r["extra"] for r in doc["records"]}
    assert set(res) == {"copy_bf16", "quantize", "copy_fp8", "dequantize"}
    assert {r["baseline"] for r in doc["records"]} == {None, "copy bf16", "copy fp8"}
    # FP8 halves the bytes: the dequantize input is about half the quantize input
    assert 0.45 < res["dequantize"]["in_bytes"] / res["quantize"]["in_bytes"] < 0.55
    assert all(
        r["gbps"] > 0 and r["peak_rss"] >= r["idle_rss"] > 0 for r in res.values()
    )
    assert list(tmp_path.iterdir()) == [out]  # temporary checkpoints removed


def test_dequantize_scale_stored_in_another_shard(tmp_path):
    src = make_fp8_checkpoint(tmp_path / "fp8")
    root = tmp_path / "fp8"
    a = root / "model-00001-of-00003.safetensors"
    b = root / "model-00003-of-00003.safetensors"
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    with safe_open(str(a), framework="pt") as h:
        ta = {k: h.get_tensor(k) for k in h.keys()}
    with safe_open(str(b), framework="pt") as h:
        tb = {k: h.get_tensor(k) for k in h.keys()}
    tb[name] = ta.pop(name)
    save_file(ta, str(a), metadata={"format": "pt"})
    save_file(tb, str(b), metadata={"format": "pt"})
    idx_path = root / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"][name] = b.name
    idx_path.write_text(json.dumps(idx))
    assert _dequantize_cli(root, tmp_path / "deq") == 0
    weight = name[: -len("_scale_inv")]
    got = load_dir(tmp_path / "deq")
    ref = naive_dequantize(src[weight], src[name], torch.bfloat16)
    assert_bit_equal(got[a.name][weight], ref)
    assert name not in got[b.name]


def vllm_skips(prefix: str, ignored_layers: list[str]) -> bool:
    """vLLM's default ``is_layer_skipped`` rule for a non-fused, non-expert layer:
    the module name is a member of ``ignored_layers`` (vllm-project/vllm
    vllm/model_executor/layers/quantization/utils/quant_utils.py)."""
    return prefix in ignored_layers


def test_ignored_layers_are_module_names_vllm_matches(tmp_path, caplog):
    make_bf16_checkpoint(tmp_path / "bf16")
    assert _quantize_cli(tmp_path / "bf16", tmp_path / "out") == 0
    got = flat(tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())[
        "quantization_config"
    ]
    ignored = qc["ignored_layers"]
    for name, t in got.items():
        if name.endswith(".weight") and t.dim() == 2:
            module = name[: -len(".weight")]
            assert vllm_skips(module, ignored) == (t.dtype != FP8), name
    assert "model.layers.1.mlp.gate" in ignored and "lm_head" in ignored
    assert not any(x.endswith(".weight") or "\\" in x for x in ignored)
    # quantizing half of what vLLM fuses (q_a_proj + kv_a_proj_with_mqa) warns
    with caplog.at_level(logging.WARNING, logger="ascend_fa.fp8"):
        quantize_checkpoint(
            tmp_path / "bf16", tmp_path / "half", ignore=["q_a_proj"], progress=False
        )
    assert "fused into one layer by vLLM" in caplog.text
    assert "model.layers.0.self_attn.q_a_proj+kv_a_proj_with_mqa" in caplog.text
