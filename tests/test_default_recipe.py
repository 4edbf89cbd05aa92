"""The packaged default recipe (pooled recall window) and the exact sample bound
``ascend-fa calibrate`` derives for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from builders import byte_tokenizer, tiny_llama  # noqa: E402

from ascend_fa.calibration import FA3QuantConfig, load_recipe  # noqa: E402
from ascend_fa.calibration.pipeline import (  # noqa: E402
    calibrate_model,
    samples_bound,
    tighten_max_samples,
)

DEFAULT = Path(__file__).resolve().parents[1] / "ascend_fa" / "recipes" / "default.yaml"

TEXTS = [
    "The tide came in slowly over the flat grey sand.",
    "def add(a, b):\n    return a + b  # 42",
    "Numbers: 3.14159, 2.71828, 1.41421, 1.73205.",
    '"Where are you going?" she asked. "North," he said.',
    "A short one.",
]


def test_default_recipe_is_pooled_recall_window():
    (item,) = load_recipe(DEFAULT).processors
    for branch, ratio in (("fa_q", 0.9999), ("fa_k", 0.9999), ("fa_v", 1.0)):
        s = item.branch_settings(branch)
        assert (s.method, s.accumulate, s.ratio) == ("recall_window", "pooled", ratio)
        assert s.max_samples == 10**9
    assert item.include == ["*"] and item.exclude == []


def test_tighten_max_samples():
    cfg = FA3QuantConfig(
        accumulate="pooled",
        max_samples=10**9,
        fa_v={"max_samples": 5 * 10**9},
        fa_k={"ratio": 0.99},
    )
    tight = tighten_max_samples(cfg, 4096)
    assert tight.max_samples == 4096
    assert tight.branch_settings("fa_v").max_samples == 4096
    assert tight.branch_settings("fa_k").ratio == 0.99  # other settings kept
    assert cfg.max_samples == 10**9  # the original is not changed
    small = FA3QuantConfig(accumulate="pooled", max_samples=100)
    assert tighten_max_samples(small, 4096) is small
    assert tighten_max_samples(cfg, None) is cfg


def _tiny_llama():
    return tiny_llama(
        hidden_size=48,
        intermediate_size=64,
        num_attention_heads=6,
        head_dim=8,
        max_position_embeddings=128,
        attn=None,
    )


def _scales(recipe, batch_size):
    model = _tiny_llama()
    processors, adapter, _ = calibrate_model(
        model,
        byte_tokenizer(),
        TEXTS,
        recipe=recipe,
        max_length=32,
        batch_size=batch_size,
    )
    out = {}
    for proc in processors:
        out.update(proc.export_scales(model))
    return out


def test_pooled_over_batches_equals_one_batch_window():
    """With the tightened bound, pooling five one-sample batches gives exactly the
    recall window of all the data at once (one batch holding every sample, where
    union and pooled coincide)."""
    pooled = _scales(load_recipe(DEFAULT), batch_size=1)
    one_batch = _scales(
        load_recipe('spec:\n  process:\n    - type: "fa3_quant"\n'),
        batch_size=len(TEXTS),
    )
    assert pooled.keys() == one_batch.keys() and len(pooled) == 2
    for branch in ("fa_q", "fa_k", "fa_v"):
        # Layer 0 sees the same activations whatever the batching: bit-equal.
        attn = "model.layers.0.self_attn"
        assert torch.equal(pooled[attn][branch][0], one_batch[attn][branch][0]), branch
        # Deeper layers see padded-batch activations that differ in the last ulp.
        attn = "model.layers.1.self_attn"
        torch.testing.assert_close(
            pooled[attn][branch][0], one_batch[attn][branch][0], rtol=1e-5, atol=0
        )


def test_samples_bound_uses_the_widest_head():
    model = _tiny_llama()
    from ascend_fa.adapters import get_adapter
    from ascend_fa.calibration import FA3Processor, find_fa_modules

    proc = FA3Processor(FA3QuantConfig())
    proc.preprocess(model, get_adapter(model))
    assert samples_bound(find_fa_modules(model), 5, 32) == 5 * 32 * 8
    proc.remove(model, get_adapter(model))
    assert samples_bound({}, 5, 32) is None
