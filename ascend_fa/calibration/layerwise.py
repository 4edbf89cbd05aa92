"""Layer-major calibration forwards: every batch through layer 0, then layer 1, ...

The batch-major loop (:func:`~ascend_fa.adapters.hf.run_forwards`) runs one whole
forward per batch, so a streamed model (:mod:`ascend_fa.streaming`) reads every
decoder layer once per batch. :func:`run_layerwise` captures the first decoder
layer's inputs of every batch (:func:`~ascend_fa.linear.engine.capture_layer_inputs`:
embeddings only), then runs all batches through layer ``i`` with the FA points
active and keeps the outputs as layer ``i + 1``'s inputs: each layer is read once.

Bit-equality with the batch-major loop: each observer sees the same tensors (a
decoder layer called with the captured keyword arguments computes what it computes
inside the model's forward) in the same batch order, and the padding mask the root
pre-hook stashes during a forward is set per batch by
:func:`~ascend_fa.adapters.base.token_mask_scope`. Models whose layers get
different masks (``config.layer_types`` mixing sliding and full attention) would
need the masks of every layer: they keep the batch-major loop
(:func:`layerwise_supported`).

:class:`LayerProgress` prints one line per finished layer (layer i/N, tokens/s,
current and peak RSS, estimated time left); :class:`LayerCheckpoint` is what a
resumable run (:mod:`.resume`) plugs in after each layer.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterable
from typing import Any, Protocol, TextIO

import torch
from torch import nn

from ascend_fa.adapters.base import token_mask_scope
from ascend_fa.adapters.hf import fa_points, find_fa_modules
from ascend_fa.linear.engine import LayerInputs, capture_layer_inputs
from ascend_fa.linear.stack import layer_step
from ascend_fa.linear.typed_inputs import layer_kwargs

from .observers import PerHeadObserver

__all__ = [
    "BeforeLayer",
    "LayerCheckpoint",
    "LayerProgress",
    "decoder_stack",
    "format_progress",
    "layer_observers",
    "layerwise_supported",
    "memory_mib",
    "run_layerwise",
]


def decoder_stack(model: nn.Module) -> nn.ModuleList | None:
    """``model.model.layers`` when it is a ``ModuleList`` (else None)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def layerwise_supported(model: nn.Module) -> bool:
    """Whether :func:`run_layerwise` applies: a decoder stack whose layers all get
    the same keyword arguments (one attention type in ``config.layer_types``)."""
    if decoder_stack(model) is None:
        return False
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return not types or len(set(types)) == 1


def layer_observers(model: nn.Module, prefix: str = "") -> dict[str, PerHeadObserver]:
    """Every observer at the FA points of attention modules named ``prefix...``:
    ``"<attn>.<fa_x>[.<path in the point>]" -> observer`` (the FA observer and, for
    KV calibration, the observer of the wrapping point)."""
    out: dict[str, PerHeadObserver] = {}
    for name, module in find_fa_modules(model).items():
        if not name.startswith(prefix):
            continue
        for branch, point in fa_points(module):
            for sub, child in point.named_modules():
                obs = getattr(child, "observer", None)
                if isinstance(obs, PerHeadObserver):
                    out[".".join(p for p in (name, branch, sub) if p)] = obs
    return out


class LayerCheckpoint(Protocol):
    """What a resumable run plugs into :func:`run_layerwise`."""

    def restore(self, model: nn.Module, inputs: list[LayerInputs]) -> int:
        """Restore the observers of the finished layers and put the carried
        activations into ``inputs``; returns the first layer to run."""
        ...

    def save(self, layer: int, model: nn.Module, inputs: list[LayerInputs]) -> None:
        """Persist layer ``layer``'s observers and its outputs ``inputs``."""
        ...


class BeforeLayer(Protocol):
    """A step :func:`run_layerwise` runs before decoder layer ``index`` observes:
    the layer, every batch's ``(hidden, kwargs, keep)`` inputs and padding mask."""

    def __call__(
        self,
        index: int,
        layer: nn.Module,
        inputs: list[LayerInputs],
        masks: list[torch.Tensor | None],
    ) -> None: ...


def memory_mib() -> tuple[float, float]:
    """``(current RSS, peak RSS)`` of this process in MiB (``/proc/self/status``
    ``VmRSS``; the peak is ``ru_maxrss``, KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    current = peak
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    current = int(line.split()[1]) / 1024
                    break
    except OSError:
        pass
    return current, peak


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_progress(
    desc: str,
    done: int,
    total: int,
    tokens_per_s: float,
    rss_mib: float,
    peak_mib: float,
    eta_s: float,
) -> str:
    """``"<desc> layer 3/30: 1234 tok/s, RSS 512 MiB (peak 780 MiB), 0:01:23
    left"``."""
    return (
        f"{desc} layer {done}/{total}: {tokens_per_s:.0f} tok/s, RSS "
        f"{rss_mib:.0f} MiB (peak {peak_mib:.0f} MiB), {_clock(eta_s)} left"
    )


class LayerProgress:
    """One line per finished layer on ``stream`` (:func:`format_progress`).

    ``tokens``: real tokens run through each layer (the rate is tokens of the
    layers finished here over the time since the first one started); the time left
    is the mean time per layer finished here times the layers left. Has the
    ``update(n)`` / ``close()`` of a progress bar, so the linear engine drives it.
    ``start`` layers are already done (a resumed run).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        tokens: int,
        *,
        start: int = 0,
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.desc, self.tokens = total, desc, tokens
        self.done = self.start = start
        self.stream = stream
        self.t0 = time.perf_counter()

    def restart(self, start: int) -> None:
        """``start`` layers are done; count time from now."""
        self.done = self.start = start
        self.t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        ran = self.done - self.start
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rss, peak = memory_mib()
        line = format_progress(
            self.desc,
            self.done,
            self.total,
            self.tokens * ran / elapsed,
            rss,
            peak,
            elapsed / max(ran, 1) * (self.total - self.done),
        )
        print(line, file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        """Nothing to tear down (the lines are already written)."""


@torch.no_grad()
def run_layerwise(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    progress: Any = None,
    checkpoint: LayerCheckpoint | None = None,
    before_layer: BeforeLayer | None = None,
) -> int:
    """Run ``batches`` through ``model``'s decoder layers layer-major (see the
    module doc; check :func:`layerwise_supported` first). The FA points observe
    exactly what the batch-major loop shows them; the final norm and the head do
    not run. ``progress`` (``update(1)`` per layer, ``restart(k)`` on resume);
    ``checkpoint`` is restored before the first layer and saved after each one;
    ``before_layer(i, layer, inputs, masks)`` runs before layer ``i`` observes
    (e.g. :class:`~ascend_fa.transforms.attention.LayerwiseTransforms`).
    Returns the number of rows per layer."""
    layers = decoder_stack(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers decoder stack")
    batches = list(batches)
    masks = [b.get("attention_mask") for b in batches]
    inputs = capture_layer_inputs(model, layers[0], batches)
    start = checkpoint.restore(model, inputs) if checkpoint is not None else 0
    if progress is not None and start and hasattr(progress, "restart"):
        progress.restart(start)
    for i in range(start, len(layers)):
        layer = layers[i]
        if before_layer is not None:
            before_layer(i, layer, inputs, masks)
        for j, (hidden, kwargs, keep) in enumerate(inputs):
            with token_mask_scope(model, masks[j]):
                out = layer(hidden, **layer_kwargs(layer, kwargs))
                out, kwargs = layer_step(out, kwargs)
            inputs[j] = (out.detach(), kwargs, keep)
        if checkpoint is not None:
            checkpoint.save(i, model, inputs)
        if progress is not None:
            progress.update(1)
    return sum(int(h.shape[0]) for h, _, _ in inputs)
