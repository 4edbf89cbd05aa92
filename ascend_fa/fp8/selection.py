"""Which tensors ``fp8 quantize`` converts, and what ``quantization_config`` says
about the rest. Torch-free, so the CLI can show the defaults without importing
torch.

Selection: the 2-D floating weights whose name matches one ``include`` pattern and
no ``ignore`` pattern (:func:`re.search`: unanchored, like ``grep -E``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .errors import FP8InputError

if TYPE_CHECKING:
    from .safetensors_io import TensorEntry

__all__ = [
    "DEFAULT_IGNORE",
    "DEFAULT_INCLUDE",
    "FLOAT_DTYPES",
    "ignored_module_names",
    "select_for_quantization",
    "warn_split_fused",
]

log = logging.getLogger("ascend_fa.fp8")

#: Linear weights of attention and MLP blocks (DeepSeek: q_a/q_b/kv_b/o_proj,
#: kv_a_proj_with_mqa, gate/up/down_proj of dense MLPs, experts and shared experts).
DEFAULT_INCLUDE: tuple[str, ...] = (r"_proj\.weight$", r"_proj_with_mqa\.weight$")

#: Kept in BF16: the LM head (the seed's ``.*lm_head``), embeddings, norms and the
#: MoE router ``mlp.gate.weight`` (its logits pick experts; FP8 would change routing).
DEFAULT_IGNORE: tuple[str, ...] = (
    r".*lm_head",
    r"embed_tokens",
    r"norm\.",
    r"mlp\.gate\.weight$",
)

#: Checkpoint projections vLLM loads into one fused layer; all of a group must
#: share one precision or vLLM refuses the checkpoint (vllm-project/vllm
#: vllm/model_executor/layers/quantization/utils/quant_utils.py is_layer_skipped,
#: commit 4de0dd6db70fbcfdb5420b3de5892d06ed1624c8, "Detected some but not all
#: shards"). The groups are the stacked params of DeepSeek's load_weights
#: (vllm/model_executor/models/deepseek_v2.py, commit
#: 002d6073aa034d4f5545d45021b0e56d1f3c3593): gate_up_proj, fused_qkv_a_proj (MLA)
#: and qkv_proj (MHA). Routed experts of one layer are one FusedMoE there too.
_FUSED_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)
#: safetensors dtypes quantize accepts.
FLOAT_DTYPES = ("BF16", "F16", "F32")


def _compile(patterns: Iterable[str], what: str) -> list[re.Pattern[str]]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except (re.error, TypeError) as exc:
            raise FP8InputError(f"invalid {what} regex {p!r}: {exc}") from None
    return out


def select_for_quantization(
    tensors: Iterable[TensorEntry],
    include: Sequence[str] = DEFAULT_INCLUDE,
    ignore: Sequence[str] = DEFAULT_IGNORE,
) -> list[str]:
    """Names of the 2-D floating tensors matching an ``include`` pattern and no
    ``ignore`` pattern (both :func:`re.search`), sorted."""
    inc, ign = _compile(include, "--include"), _compile(ignore, "--ignore")
    return sorted(
        t.name
        for t in tensors
        if len(t.shape) == 2
        and t.dtype in FLOAT_DTYPES
        and any(r.search(t.name) for r in inc)
        and not any(r.search(t.name) for r in ign)
    )


def ignored_module_names(
    tensors: Iterable[TensorEntry], selected: Iterable[str]
) -> list[str]:
    """``quantization_config.ignored_layers``: the MODULE names (``<name>`` of
    ``<name>.weight``) of the 2-D floating weights left unquantized, e.g.
    ``model.layers.3.mlp.gate``, ``lm_head``.

    vLLM's ``Fp8Config.from_config`` reads ``ignored_layers`` and
    ``get_quant_method`` asks ``is_layer_skipped(prefix, ignored_layers, ...)`` for
    every linear / fused-MoE layer, where ``prefix`` is the module name and the
    default match is exact membership (vllm-project/vllm
    vllm/model_executor/layers/quantization/fp8.py, commit
    1436674bcb3f46f4c960d09334cf7dd1534943ca; utils/quant_utils.py
    ``is_layer_skipped``, commit 4de0dd6db70fbcfdb5420b3de5892d06ed1624c8): tensor
    names or regexes never match.
    """
    chosen = set(selected)
    return sorted(
        t.name[: -len(".weight")]
        for t in tensors
        if t.name.endswith(".weight")
        and t.name not in chosen
        and len(t.shape) == 2
        and t.dtype in FLOAT_DTYPES
    )


def warn_split_fused(names: Iterable[str], selected: set[str]) -> None:
    """Warn when vLLM would load tensors of different precisions as one layer."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        if not n.endswith(".weight"):
            continue
        module = n[: -len(".weight")]
        parent, _, leaf = module.rpartition(".")
        for group in _FUSED_GROUPS:
            if leaf in group:
                groups.setdefault(f"{parent}.{'+'.join(group)}", []).append(n)
        head, sep, _ = module.partition(".experts.")
        if sep:
            groups.setdefault(f"{head}.experts", []).append(n)
    for key, members in groups.items():
        if len({m in selected for m in members}) > 1:
            mixed = [m for m in members if m not in selected][:2]
            log.warning(
                "%s are fused into one layer by vLLM but only some are quantized "
                "(e.g. %s kept in BF16); vLLM refuses or misloads such a checkpoint",
                key,
                ", ".join(mixed),
            )
