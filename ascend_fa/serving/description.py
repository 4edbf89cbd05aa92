"""What the ``"ascend"`` quantization of the vLLM plugin reads from an artifact's
``quant_model_description.json``; no vLLM import here.

vllm-ascend reads the description the same way
(vllm-project/vllm-ascend ``vllm_ascend/quantization/modelslim_config.py``): a
layer's type is the type of ``<prefix>.weight``; a fused vLLM layer (``qkv_proj``,
``gate_up_proj``) takes the type of its shards, which must agree; a layer the
description does not name is float.

=================  =======================================================  ========
type               layers                                                   emulated
=================  =======================================================  ========
``FLOAT``          any                                                      yes
``W8A8``           linear (static per-tensor activation, per-channel        yes
                   weight, ``deq_scale``, ``quant_bias``)
``W8A8_DYNAMIC``   linear, MoE experts (per-token activation)               yes
``FAQuant``        attention (MindIE's FA3: Q/K/V int8 per head, static)    yes
``C8``             KV cache (vllm-ascend's int8 per-channel cache)          yes
``FAKQuant``       MLA attention (DeepSeek: int8 latent cache, query int8   yes
                   per head, static; ``fa_quant_type``)
=================  =======================================================  ========

(see docs/guides/serve-vllm.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ascend_fa.artifact.format import (
    FA_QUANT_TYPES,
    TARGET_METADATA_KEY,
    description_problem,
    is_meta_key,
)
from ascend_fa.errors import FileFormatError, UnsupportedError

__all__ = [
    "ATTENTION_TYPES",
    "LINEAR_TYPES",
    "ServingDescription",
    "check_tensors",
    "tensor_dtypes",
]

#: Linear (and MoE expert) types the plugin runs with the device's integer path.
LINEAR_TYPES = ("FLOAT", "W8A8", "W8A8_DYNAMIC")
#: Attention / KV types the plugin loads.
ATTENTION_TYPES = ("FAQuant", "C8")


class ServingDescription:
    """A validated description: ``types`` maps every tensor name to its type.

    Raises :class:`~ascend_fa.errors.FileFormatError` (a value that is not a
    string) or :class:`~ascend_fa.errors.UnsupportedError` (a type the plugin does
    not run), each one line naming the key.
    """

    def __init__(self, desc: Mapping[str, Any]):
        problem = description_problem(desc)
        if problem is not None:
            raise FileFormatError(f"quant_model_description.json: {problem}")
        self.raw = dict(desc)
        self.types: dict[str, str] = {}
        for key, value in desc.items():
            if is_meta_key(key, value) or key == "moe_quantize":
                continue
            if value not in LINEAR_TYPES + ATTENTION_TYPES:
                raise UnsupportedError(
                    f"quant_model_description.json: {key} has type {value!r}; the "
                    f"ascend-fa vLLM plugin runs {', '.join(LINEAR_TYPES)} linears "
                    f"and {', '.join(ATTENTION_TYPES)} attention"
                )
            self.types[key] = value
        fa = desc.get("fa_quant_type")
        if fa is not None and fa not in FA_QUANT_TYPES:
            raise UnsupportedError(
                f"quant_model_description.json: fa_quant_type {fa!r} is not one of "
                f"{', '.join(FA_QUANT_TYPES)}"
            )
        kv = desc.get("kv_cache_type")
        if kv is not None and kv != "C8":
            raise UnsupportedError(
                f"quant_model_description.json: kv_cache_type {kv!r} is not C8"
            )

    @property
    def fa_quant_type(self) -> str | None:
        return self.raw.get("fa_quant_type")

    @property
    def target(self) -> str | None:
        """The consumer the artifact was written for, as ascend-fa records it
        (``metadata.ascend_fa_target``; None for other writers)."""
        meta = self.raw.get("metadata")
        return meta.get(TARGET_METADATA_KEY) if isinstance(meta, dict) else None

    @property
    def kv_cache_type(self) -> str | None:
        return self.raw.get("kv_cache_type")

    def linear_type(
        self, prefix: str, packed: Mapping[str, Sequence[str]] | None = None
    ) -> str:
        """The type of the vLLM linear at ``prefix``: ``FLOAT`` when the
        description does not name its weight. A fused layer whose last name is a
        key of ``packed`` (``qkv_proj -> [q_proj, k_proj, v_proj]``) takes its
        shards' common type; shards of different types raise."""
        head, _, proj = prefix.rpartition(".")
        shards = (packed or {}).get(proj)
        if not shards:
            return self.types.get(f"{prefix}.weight", "FLOAT")
        names = [f"{head}.{s}.weight" if head else f"{s}.weight" for s in shards]
        kinds = [self.types.get(n, "FLOAT") for n in names]
        if len(set(kinds)) > 1:
            listed = ", ".join(f"{n} {k}" for n, k in zip(names, kinds))
            raise UnsupportedError(
                f"{prefix}: vLLM fuses {', '.join(shards)} into one layer and needs "
                f"one type for all of them, the description gives {listed}"
            )
        return kinds[0]

    def expert_type(self, prefix: str) -> str:
        """The common type of the routed experts under ``prefix``
        (``...mlp.experts``): every ``<prefix>.<e>.*_proj.weight``."""
        kinds = {
            t
            for n, t in self.types.items()
            if n.startswith(prefix + ".") and n.endswith("_proj.weight")
        }
        if len(kinds) > 1:
            raise UnsupportedError(
                f"{prefix}: the experts have types {sorted(kinds)}; vLLM's FusedMoE "
                "runs one type for all"
            )
        return kinds.pop() if kinds else "FLOAT"


#: Tensors each quantized linear type needs beside ``<p>.weight`` (vllm-ascend
#: ``methods/w8a8_static.py`` / ``w8a8_dynamic.py`` parameters).
_NEEDS = {
    "W8A8": ("input_scale", "input_offset", "deq_scale", "quant_bias"),
    "W8A8_DYNAMIC": ("weight_scale",),
}
_QUANT_ONLY = ("input_scale", "input_offset", "deq_scale", "quant_bias")
#: The description names a tied ``lm_head.weight`` that the weight files may not
#: hold (vLLM ties it to the embedding).
TIED_HEAD = "lm_head.weight"


def check_tensors(desc: ServingDescription, dtypes: Mapping[str, str]) -> None:
    """Raise :class:`~ascend_fa.errors.FileFormatError` (one line naming the
    tensor) where the description and the weight files disagree. ``dtypes`` maps
    every tensor of the weight files to its safetensors dtype (``"I8"``,
    ``"BF16"``, ...): each tensor is described and each described tensor exists;
    a quantized linear's weight is int8 and its other tensors are there; a
    ``FLOAT`` weight is a float tensor without a quantized linear's tensors."""
    where = "quant_model_description.json"
    for name in dtypes:
        if name not in desc.types:
            raise FileFormatError(f"{name}: in the weight files, not in {where}")
    for name, kind in desc.types.items():
        if name not in dtypes:
            if name == TIED_HEAD and kind == "FLOAT":
                continue  # a tied head: described, stored as the embedding
            raise FileFormatError(f"{where}: {name} ({kind}) is not in the weights")
        if not name.endswith(".weight") or kind not in LINEAR_TYPES:
            continue
        prefix = name[: -len(".weight")]
        if kind == "FLOAT":
            if dtypes[name] == "I8":
                raise FileFormatError(
                    f"{name}: int8 in the weights, {where} says FLOAT"
                )
            extra = [s for s in _QUANT_ONLY if f"{prefix}.{s}" in dtypes]
            if extra:
                raise FileFormatError(
                    f"{prefix}.{extra[0]}: a quantized linear's tensor, {where} "
                    f"says {name} is FLOAT"
                )
            continue
        if dtypes[name] != "I8":
            raise FileFormatError(
                f"{name}: {dtypes[name]} in the weights, {where} says {kind} "
                "(int8 codes)"
            )
        missing = [s for s in _NEEDS[kind] if f"{prefix}.{s}" not in dtypes]
        if missing:
            raise FileFormatError(
                f"{prefix}.{missing[0]}: missing from the weights ({where} says "
                f"{name} is {kind})"
            )


def tensor_dtypes(directory: str | Path) -> dict[str, str]:
    """Every tensor of an artifact's weight files -> its safetensors dtype
    (headers only)."""
    from safetensors import safe_open

    from ascend_fa.artifact.reader import read_tensor_index

    out: dict[str, str] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in read_tensor_index(directory).items():
        by_file.setdefault(Path(path), []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                out[name] = f.get_slice(name).get_dtype()
    return out
