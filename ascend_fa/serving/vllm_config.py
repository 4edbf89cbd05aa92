"""The ``"ascend"`` quantization method of vLLM, registered by
:func:`ascend_fa.serving.register` (this module imports vLLM; nothing in
``import ascend_fa`` imports it).

vLLM's ``get_quant_config`` reads :meth:`AscendQuantConfig.get_config_filenames`
(``quant_model_description.json``) from the model directory, as vllm-ascend's
``AscendModelSlimConfig`` does (vllm-project/vllm-ascend
``vllm_ascend/quantization/modelslim_config.py``); the artifact's config.json
carries no ``quantization_config``. At start-up :meth:`AscendQuantConfig.
maybe_update_config` checks the artifact with ``ascend-fa inspect``'s rules
(:func:`ascend_fa.artifact.inspect.inspect_artifact`) and stops on the first
finding, one line naming the tensor or rule.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import WeightsMapper

from ascend_fa.artifact.format import DESCRIPTION_FILE

from .description import ServingDescription
from .linear import AscendW8A8DynamicLinearMethod, AscendW8A8LinearMethod

__all__ = ["QUANT_METHOD", "AscendQuantConfig"]

logger = init_logger(__name__)

#: The method name (vllm-ascend's ``ASCEND_QUANTIZATION_METHOD``).
QUANT_METHOD = "ascend"

_LINEAR_METHODS = {
    "W8A8": AscendW8A8LinearMethod,
    "W8A8_DYNAMIC": AscendW8A8DynamicLinearMethod,
}


@register_quantization_config(QUANT_METHOD)
class AscendQuantConfig(QuantizationConfig):
    """An artifact's ``quant_model_description.json`` as vLLM's quantization
    config: each layer's method from its description type
    (:meth:`ServingDescription.linear_type`)."""

    # the attention scales are loaded as named below, not as vLLM's q/k/v_scale
    _ignore_unexpected_suffixes = ()

    def __init__(self, description: ServingDescription):
        super().__init__()
        self.description = description
        self._attention_warned = False

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [DESCRIPTION_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendQuantConfig:
        return cls(ServingDescription(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        """Refuse an artifact ``ascend-fa inspect`` finds invalid (start-up)."""
        from pathlib import Path

        from ascend_fa.artifact.inspect import inspect_artifact

        if not Path(model_name).is_dir():
            return
        result = inspect_artifact(model_name)
        if result["findings"] and not result["valid"]:
            raise ValueError(
                f"{model_name}: not a loadable Ascend artifact: {result['findings'][0]}"
            )

    def get_cache_scale_mapper(self) -> WeightsMapper:
        """FA scales ``<attn>.fa_q.scale`` load as ``<attn>.attn.fa_q_scale``;
        C8 ``<attn>.k_proj.kv_cache_scale`` as ``<attn>.attn.k_cache_scale``.
        Until the attention backend runs them they are dropped here (the
        attention runs on vLLM's float cache; logged once)."""
        return WeightsMapper(
            orig_to_new_regex={
                re.compile(r"\.fa_[qkv]\.(scale|offset)$"): None,
                re.compile(r"\.[kv]_proj\.kv_cache_(scale|offset)$"): None,
            }
        )

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            kind = self.description.linear_type(prefix, self.packed_modules_mapping)
            method = _LINEAR_METHODS.get(kind)
            return UnquantizedLinearMethod() if method is None else method()
        if isinstance(layer, VocabParallelEmbedding):
            return UnquantizedEmbeddingMethod()
        self._warn_attention()
        return None

    def _warn_attention(self) -> None:
        d = self.description
        schemes = [s for s in (d.fa_quant_type, d.kv_cache_type) if s]
        if schemes and not self._attention_warned:
            self._attention_warned = True
            logger.warning(
                "ascend-fa: %s attention is not emulated in vLLM yet; attention "
                "runs on vLLM's float KV cache (the linears are emulated)",
                "/".join(schemes),
            )
