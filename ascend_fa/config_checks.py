"""Structural keys of a model's ``config.json``, judged before the model is built.

transformers builds a model from almost any numbers: ``num_hidden_layers: 0``,
``head_dim: 0`` or more routed experts per token than experts only fail deep in
a forward (an ``IndexError``, a ``ZeroDivisionError``, "selected index k out of
range"), and some impossible values (a ``sliding_window`` of 0, a top-level
``rope_theta`` that contradicts ``rope_parameters``) run without a word but
compute something no model computes. :func:`check_model_config` refuses them
first, each failure one :class:`~ascend_fa.errors.FileFormatError` naming the
file, the key and the value (a long value cut).

The rules hold for every family (a key a family does not have is not checked):

==================================  ============================================
key                                 rule
==================================  ============================================
sizes and counts (:data:`SIZES`)    an integer > 0 (null allowed where a family
                                    leaves it unset; ``sliding_window`` >= 0 with
                                    ``use_sliding_window`` false)
:data:`COUNTS`                      an integer >= 0
``num_experts_per_tok``             <= the routed experts (``num_experts``,
                                    ``n_routed_experts``, ``num_local_experts``)
``topk_group``                      <= ``n_group``
``num_attention_heads``             a multiple of ``num_key_value_heads``
``partial_rotary_factor``           a number in (0, 1] (top level or in
                                    ``rope_parameters``)
``rope_theta``                      a finite number > 0 (top level or in
                                    ``rope_parameters``)
``rope_theta`` vs                   equal when both are given: transformers 5
``rope_parameters.rope_theta``      reads one, transformers-4 consumers the other
(or its ``full_attention`` entry)
``rope_scaling.factor``             a finite number > 0
``layer_types``, ``indexer_types``  a list of strings, one per layer
``mlp_only_layers``                 layer indices in ``[0, num_hidden_layers)``
==================================  ============================================

A multimodal config's ``text_config`` is judged the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ascend_fa.errors import FileFormatError

__all__ = ["SIZES", "COUNTS", "check_model_config"]

#: Keys that are sizes or counts of something a model has at least one of.
SIZES = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "rotary_dim",
    "sliding_window",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
)
#: Keys that count something a model may have none of.
COUNTS = ("n_shared_experts", "first_k_dense_replace")
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")
_PER_LAYER = ("layer_types", "indexer_types")


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Judge:
    def __init__(self, path: Path, prefix: str) -> None:
        self.path, self.prefix = path, prefix

    def fail(self, key: str, value: Any, why: str) -> None:
        raise FileFormatError(
            f"model config: {self.prefix}{key} is {_show(value)}, {why}",
            path=self.path,
        )

    def int_at_least(self, cfg: Mapping[str, Any], key: str, low: int) -> None:
        value = cfg.get(key)
        if value is None:
            return
        if not _is_int(value) or value < low:
            self.fail(key, value, f"expected an integer >= {low}")

    def rope_number(self, cfg: Mapping[str, Any], key: str, where: str) -> None:
        value = cfg.get(key)
        if value is None:
            return
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            self.fail(where, value, "expected a finite number > 0")
        if key == "partial_rotary_factor" and value > 1:
            self.fail(where, value, "expected a fraction in (0, 1]")


def _rope_dicts(cfg: Mapping[str, Any], judge: _Judge) -> list[tuple[str, Any]]:
    """``(name, dict)`` of ``rope_parameters`` (flat, or one per layer type) and
    ``rope_scaling``."""
    out = []
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            judge.fail(key, value, "expected a JSON object or null")
        if value and all(isinstance(v, Mapping) for v in value.values()):
            out.extend((f"{key}.{k}", v) for k, v in value.items())
        else:
            out.append((key, value))
    return out


def _check_rope(cfg: Mapping[str, Any], judge: _Judge) -> None:
    judge.rope_number(cfg, "rope_theta", "rope_theta")
    judge.rope_number(cfg, "partial_rotary_factor", "partial_rotary_factor")
    for name, params in _rope_dicts(cfg, judge):
        for key in ("rope_theta", "partial_rotary_factor", "factor"):
            judge.rope_number(params, key, f"{name}.{key}")
        top, inner = cfg.get("rope_theta"), params.get("rope_theta")
        # the flat parameters, or the full-attention layers' (Gemma 3: the
        # top-level theta is the global one, rope_local_base_freq the local)
        paired = name in ("rope_parameters", "rope_parameters.full_attention")
        if paired and top is not None and inner is not None:
            if float(top) != float(inner):
                judge.fail(
                    "rope_theta",
                    top,
                    f"but {name}.rope_theta is {_show(inner)}: "
                    "transformers 5 reads one and transformers-4 consumers the "
                    "other; keep one value",
                )


def _check(cfg: Mapping[str, Any], judge: _Judge) -> None:
    for key in SIZES:
        # transformers writes sliding_window 0 for a window switched off
        # (Qwen2-MoE: use_sliding_window false)
        off = key == "sliding_window" and cfg.get("use_sliding_window") is False
        judge.int_at_least(cfg, key, 0 if off else 1)
    for key in COUNTS:
        judge.int_at_least(cfg, key, 0)
    experts = next((cfg[k] for k in _EXPERTS if cfg.get(k) is not None), None)
    top_k = cfg.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        judge.fail(
            "num_experts_per_tok", top_k, f"more than the {experts} routed experts"
        )
    n_group, topk_group = cfg.get("n_group"), cfg.get("topk_group")
    if n_group is not None and topk_group is not None and topk_group > n_group:
        judge.fail("topk_group", topk_group, f"more than n_group {n_group}")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        judge.fail(
            "num_attention_heads", heads, f"not a multiple of num_key_value_heads {kv}"
        )
    _check_rope(cfg, judge)
    layers = cfg.get("num_hidden_layers")
    for key in _PER_LAYER:
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            judge.fail(key, value, "expected a list of strings, one per layer")
        if layers is not None and len(value) != layers:
            judge.fail(
                key, value, f"{len(value)} entries for num_hidden_layers {layers}"
            )
    mlp_only = cfg.get("mlp_only_layers")
    if mlp_only is not None and layers is not None:
        if not isinstance(mlp_only, list) or not all(
            _is_int(i) and 0 <= i < layers for i in mlp_only
        ):
            judge.fail(
                "mlp_only_layers", mlp_only, f"expected layer indices < {layers}"
            )


def check_model_config(config: Mapping[str, Any], path: str | Path) -> None:
    """Refuse ``config`` (read from ``path``) when a structural key breaks the
    rules of the module doc; the error names ``path``, the key and the value."""
    _check(config, _Judge(Path(path), ""))
    text = config.get("text_config")
    if isinstance(text, Mapping):
        _check(text, _Judge(Path(path), "text_config."))
