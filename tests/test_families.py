"""The model-family registry (:mod:`ascend_fa.families`) is what the adapters, the
linear plans, the transforms and the emulation read: a GQA family declared there
(and nowhere else) is calibrated like its kind."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from builders import tiny_llama  # noqa: E402

from ascend_fa import families  # noqa: E402
from ascend_fa.adapters import GQAAdapter, get_adapter, supported_model_types  # noqa: E402
from ascend_fa.emulation import SUPPORTED_MODEL_TYPES  # noqa: E402
from ascend_fa.errors import UnsupportedError  # noqa: E402
from ascend_fa.linear.plan import GQA_MODEL_TYPES, linear_plan  # noqa: E402
from ascend_fa.transforms.residual import (  # noqa: E402
    ROTATABLE_MODEL_TYPES,
    supports_rotation,
)


def test_the_consumers_derive_their_model_types_from_the_registry():
    assert supported_model_types() == sorted(families.FAMILIES)
    gqa = tuple(t for t, k in families.FAMILIES.items() if k is families.GQA)
    assert gqa[:4] == ("llama", "qwen2", "qwen3", "mistral")
    moe = tuple(t for t, k in families.FAMILIES.items() if k is families.GQA_MOE)
    assert {"qwen3_moe", "qwen2_moe", "glm4_moe", "mixtral", "minimax_m2"} <= set(moe)
    assert ROTATABLE_MODEL_TYPES == gqa
    # gemma3_text: GQA attention and plan, no residual rotation (sandwich norms)
    gemma = ("gemma3_text",)
    assert GQA_MODEL_TYPES == SUPPORTED_MODEL_TYPES == gqa + moe + gemma
    assert families.is_mla("deepseek_v3") and not families.is_mla("llama")
    assert not families.is_mla(None) and families.attention_kind("gpt2") is None
    mla = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
    assert set(mla) <= set(families.model_types(kv_cache_targets=False))


def _renamed(model_type: str) -> torch.nn.Module:
    model = tiny_llama()
    model.config.model_type = model_type
    return model


def test_a_gqa_family_added_to_the_registry_only(monkeypatch):
    unknown = _renamed("llama_like")
    with pytest.raises(ValueError, match="no FA3 adapter for model type 'llama_like'"):
        get_adapter(unknown)
    with pytest.raises(UnsupportedError, match="no quantized-linear plan"):
        linear_plan(unknown)
    assert not supports_rotation(unknown)

    monkeypatch.setitem(families.FAMILIES, "llama_like", families.GQA)
    model = _renamed("llama_like")
    assert isinstance(get_adapter(model), GQAAdapter)
    assert "llama_like" in supported_model_types()
    assert supports_rotation(model)
    plans, reference = linear_plan(model), linear_plan(tiny_llama())
    assert [[g.linears for g in p.groups] for p in plans] == [
        [g.linears for g in p.groups] for p in reference
    ]
