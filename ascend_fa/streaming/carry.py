"""Checkpoint tensors the model code does not run, carried into the artifact.

DeepSeek-V3's official checkpoint holds a multi-token-prediction (MTP) layer as
``model.layers.<num_hidden_layers>.*`` (one layer past the decoder stack;
``num_nextn_predict_layers`` of them). transformers' ``DeepseekV3ForCausalLM`` has
no module for it (``_keys_to_ignore_on_load_unexpected`` drops
``model.layers.61.*``), so it is not calibrated here; the artifact still carries
its tensors, cast to the artifact dtype like every float weight and typed
``"FLOAT"``, so that a consumer that runs MTP finds them. The whole-model and the
streaming path both append them after the model's own tensors, in checkpoint-name
order.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ascend_fa.artifact import LazyTensors, TensorSpec

__all__ = ["carried_names", "carried_tensors"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def carried_names(names: list[str], num_layers: int) -> list[str]:
    """The names of layers past the decoder stack (index >= ``num_layers``)."""
    out = []
    for name in names:
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) >= num_layers:
            out.append(name)
    return sorted(out)


def carried_tensors(
    source_dir: Path, num_layers: int, dtype: torch.dtype | None
) -> LazyTensors:
    """``source_dir``'s tensors past the decoder stack, each read (through
    :class:`~ascend_fa.fp8.CheckpointReader`: FP8 blocks dequantized) and cast to
    ``dtype`` when the writer reaches it."""
    from ascend_fa.fp8 import CheckpointReader

    reader = CheckpointReader(source_dir)
    specs = {}
    for name in carried_names(reader.names(), num_layers):
        info = reader.metadata(name)
        out = dtype if dtype is not None and info.dtype.is_floating_point else None
        specs[name] = TensorSpec(tuple(info.shape), out or info.dtype)

    def load(name: str) -> torch.Tensor:
        return reader.tensor(name).to(specs[name].dtype).contiguous()

    return LazyTensors(specs, load)
