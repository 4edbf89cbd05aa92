"""Layer-major calibration forwards (:mod:`ascend_fa.calibration.layerwise`).

Tiny real transformers models (Llama GQA, Qwen2 with biases, DeepSeek-V3 MLA with
a dense first layer and routed + shared experts) calibrated on several padded
batches, once batch-major and once layer-major: every exported scale and every
calibrated range bit-equal, for FAQuant scales and for the C8 / FP8 KV observers.
A streamed checkpoint is read once per layer for the whole pass.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from builders import DEEPSEEK_TINY, byte_tokenizer, tiny_causal_lm

from ascend_fa.calibration.job import default_recipe_path
from ascend_fa.calibration.kv import KVCalibration
from ascend_fa.calibration.layerwise import (
    LayerProgress,
    format_progress,
    layerwise_supported,
)
from ascend_fa.calibration.pipeline import calibrate_model
from ascend_fa.calibration.recipe import load_recipe

TEXTS = [
    f"text {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 3) + str(i * 13)
    for i in range(7)
]


def _model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=260, max_position_embeddings=128)
    if kind == "deepseek_v3":
        return tiny_causal_lm(
            kind, **common, **{**DEEPSEEK_TINY, "num_hidden_layers": 3}
        )
    return tiny_causal_lm(
        kind,
        **common,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
    )


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _calibrate(model, tokenizer, *, layerwise: bool, kv: str | None):
    recipe = load_recipe(default_recipe_path())
    cal = KVCalibration(kv, max_tokens=len(TEXTS) * 40) if kv else None
    result = calibrate_model(
        model,
        tokenizer,
        TEXTS,
        recipe=recipe,
        max_length=40,
        batch_size=2,
        progress=False,
        layerwise=layerwise,
        wrap=cal.wrap if cal else None,
    )
    scales = result.export_scales(model)
    ranges = result.ranges
    kv_scales = cal.scales("attn_head") if cal else {}
    result.remove(model)
    return scales, ranges, kv_scales


@pytest.mark.parametrize(
    ("kind", "padding", "kv"),
    [
        ("llama", "right", None),
        ("llama", "left", "c8"),
        ("qwen2", "right", "fp8"),
        ("deepseek_v3", "left", None),
    ],
)
def test_layer_major_scales_bit_equal_batch_major(kind, padding, kv):
    model = _model(kind)
    assert layerwise_supported(model)
    tok = byte_tokenizer(padding)
    a = _calibrate(model, tok, layerwise=False, kv=kv)
    b = _calibrate(model, tok, layerwise=True, kv=kv)
    scales_a, scales_b = a[0], b[0]
    assert scales_a and set(scales_a) == set(scales_b)
    for attn, branches in scales_a.items():
        for branch, (scale, offset) in branches.items():
            other = scales_b[attn][branch]
            assert _bits(scale) == _bits(other[0]), (attn, branch)
            assert _bits(offset) == _bits(other[1]), (attn, branch)
    for attn, branches in a[1].items():
        for branch, (lo, hi) in branches.items():
            lo2, hi2 = b[1][attn][branch]
            assert _bits(lo) == _bits(lo2) and _bits(hi) == _bits(hi2)
    assert set(a[2]) == set(b[2])
    for attn, sides in a[2].items():
        for side, scale in sides.items():
            assert _bits(scale) == _bits(b[2][attn][side]), (attn, side)


def test_mixed_layer_types_keep_the_batch_major_loop():
    model = _model("qwen2")
    model.config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    assert not layerwise_supported(model)


def test_progress_line_format():
    line = format_progress("attention", 3, 30, 1234.4, 512.2, 780.9, 83)
    assert line == (
        "attention layer 3/30: 1234 tok/s, RSS 512 MiB (peak 781 MiB), 0:01:23 left"
    )
    out = io.StringIO()
    bar = LayerProgress(4, "linears", 100, stream=out)
    bar.restart(1)
    bar.update(1)
    bar.update(1)
    lines = out.getvalue().splitlines()
    pattern = (
        r"linears layer (\d)/4: \d+ tok/s, RSS \d+ MiB \(peak \d+ MiB\), "
        r"\d+:\d\d:\d\d left"
    )
    assert [re.fullmatch(pattern, x)[1] for x in lines] == ["2", "3"]
