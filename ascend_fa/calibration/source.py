"""The second stage of ``calibrate``: the model to calibrate.

:func:`open_source` loads the whole model onto the device, or (``--streaming``)
opens the checkpoint as a skeleton whose decoder layers load one at a time from
the shards (:mod:`ascend_fa.streaming`), with the resume state of an earlier
interrupted run (:mod:`.resume`). Then the checks that need the loaded model
(its real ``model_type``: a GGUF file has no ``config.json`` to plan from).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_fa import parallel
from ascend_fa.families import AttentionKind, attention_kind, is_mla

from .plan import CalibrationPlan

__all__ = ["Source", "open_source"]


@dataclass
class Source:
    """The loaded model (``loaded``: model, tokenizer, where it came from), on
    ``device``; ``streamed`` and ``resume`` for a streaming run; ``seconds`` it
    took to open."""

    loaded: Any
    net: nn.Module
    device: torch.device
    streamed: Any = None
    resume: Any = None
    seconds: float = 0.0

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def model_type(self) -> str:
        return self.net.config.model_type

    @property
    def mla(self) -> bool:
        return is_mla(self.model_type)

    @property
    def kind(self) -> AttentionKind | None:
        """The model's attention kind (:mod:`ascend_fa.families`)."""
        return attention_kind(self.model_type)

    @property
    def name(self) -> str:
        """The checkpoint directory, or the GGUF file, the model came from."""
        loaded = self.loaded
        if loaded.gguf_file:
            return str(loaded.source_dir / loaded.gguf_file)
        return str(loaded.source_dir)

    def kv_mode(self, target: str) -> str | None:
        """``"c8"`` / ``"fp8"`` when ``target`` deploys a quantized KV cache for
        this model (GQA on vllm-ascend / vllm), else None (FA scales)."""
        if self.kind is not None and not self.kind.kv_cache_targets:
            return None
        return {"vllm-ascend": "c8", "vllm": "fp8"}.get(target)

    def batches(self, plan: CalibrationPlan, texts: list[str]) -> Any:
        """``texts`` as padded device batches (the unsplit samples of the
        transforms and the error budget: every rank runs them whole)."""
        from .pipeline import calibration_batches

        return calibration_batches(
            self.tokenizer,
            texts,
            max_length=plan.max_length,
            batch_size=plan.batch_size,
            device=self.device,
        )

    def spilling(self) -> Any:
        """A streaming run saves the layers it changes while in this block."""
        return self.streamed.spilling() if self.streamed else contextlib.nullcontext()

    def close(self) -> None:
        """The run is over: a streaming run's work directory goes (an
        interrupted run keeps it, to resume)."""
        if self.streamed is not None:
            self.streamed.close()


def open_source(plan: CalibrationPlan, device: torch.device) -> Source:
    """The model of ``plan`` on ``device``, whole or streamed, checked against
    the target and the merge export now that its config is known."""
    t0 = time.perf_counter()
    if plan.streaming:
        source = _streamed(plan, device)
    else:
        from ascend_fa.models import load_model

        with parallel.rank_zero_first():  # a model cache is written once
            loaded = load_model(plan.model, plan.gguf_file, cache=plan.cache)
        source = Source(loaded, loaded.model.to(device), device)
    source.seconds = time.perf_counter() - t0
    check_loaded(plan, source)
    return source


def check_loaded(plan: CalibrationPlan, source: Source) -> None:
    """The target's and the merge export's checks again, with the loaded
    model's own config."""
    from ascend_fa import artifact

    artifact.check_target(
        plan.target,
        mla=source.mla,
        model_quant_type=plan.linear_type,
        merge=plan.merge,
        model_type=source.model_type,
    )
    if plan.merge:
        artifact.check_merge_export(plan.merge_into, source.net.config.to_dict())


def _streamed(plan: CalibrationPlan, device: torch.device) -> Source:
    from ascend_fa import artifact
    from ascend_fa.streaming import open_streamed

    assert plan.output is not None
    # Each rank spills its own changed layers (a rank's own work dir).
    me = parallel.rank()
    tag = f".rank{me}" if me else ""
    output = Path(plan.output)
    work = output.parent / f".{output.name}.streaming{tag}"
    loaded, streamed = open_streamed(plan.model, work, device=device)
    if plan.max_memory is not None:
        streamed.check_memory(
            artifact.parse_size(plan.max_memory), len(plan.calib), plan.max_length
        )
    source = Source(loaded, loaded.model, device, streamed)
    if parallel.world_size() > 1:
        # Ranks hold different activations and may stop at different layers: a
        # data-parallel run keeps no resume state (a rerun starts over) and
        # drops an earlier run's spills.
        streamed.drop_spills()
    else:
        source.resume = _resume_state(plan, work, streamed, device)
    return source


def _resume_state(
    plan: CalibrationPlan, work: Path, streamed: Any, device: torch.device
) -> Any:
    """The resume state of a streaming run in ``work`` (:mod:`.resume`), bound to
    the streamed model: spill files of layers it does not count as done (an
    earlier run's) are dropped. Prints the one line saying it resumes or why an
    earlier state was discarded."""
    from .resume import open_resume, run_fingerprint

    fingerprint = run_fingerprint(
        Path(plan.model),  # type: ignore[arg-type]
        plan.calib + plan.held,
        plan.fingerprint_arguments(device),
    )
    state, note = open_resume(work, fingerprint, len(streamed.layers))
    if note:
        print(note, file=sys.stderr, flush=True)
    state.streamed, state.dtype = streamed, plan.dtype
    streamed.drop_spills(state.linear_done)
    return state
