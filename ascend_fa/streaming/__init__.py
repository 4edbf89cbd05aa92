"""Streaming calibration: one decoder layer in memory, loaded from the shards.

``calibrate --streaming`` runs the calibration of ``calibrate`` on a
:class:`StreamedModel` (the skeleton, one resident decoder layer; see
:mod:`.model`) instead of a loaded model, and writes the artifact one tensor at a
time (:class:`~ascend_fa.artifact.LazyTensors`): the same steps on the same values,
so the same artifact, with memory independent of depth.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ascend_fa.errors import FileFormatError, InputError
from ascend_fa.models import LoadedModel, check_model_files

from .model import Source, StreamedModel
from .plan import StreamPlan, plan_streaming

__all__ = ["Source", "StreamPlan", "StreamedModel", "open_streamed", "plan_streaming"]


def open_streamed(
    model: str | Path | None,
    work_dir: Path,
    *,
    device: torch.device | str = "cpu",
) -> tuple[LoadedModel, StreamedModel]:
    """The Hugging Face checkpoint directory ``model`` as a :class:`StreamedModel`
    (spill files under ``work_dir``) and a :class:`~ascend_fa.models.LoadedModel`
    holding its skeleton and tokenizer (padding with EOS when it has no pad
    token, as :func:`~ascend_fa.models.load_model` does)."""
    from transformers import AutoTokenizer

    if model is None or not Path(model).is_dir():
        raise InputError(
            "--streaming reads a Hugging Face checkpoint directory's safetensors "
            "shards; pass --model DIR"
        )
    source = Path(model)
    check_model_files(source)
    streamed = StreamedModel(source, work_dir, device=device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise FileFormatError(
            f"cannot load the tokenizer: {text}", path=source
        ) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = LoadedModel(
        model=streamed.model, tokenizer=tokenizer, source_dir=source, gguf_file=None
    )
    return loaded, streamed
