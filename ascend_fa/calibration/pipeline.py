"""The calibration loop, once: tokenize in padded batches, run forwards, observe.

:func:`run_forwards` is the one loop every calibration path calls (the calibrate
verb, the clip search, the method comparison and the calibration benchmark);
:func:`calibrate_model` is inject -> observe -> fake-quantize around it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from ascend_fa import parallel
from ascend_fa.adapters import injected_points
from ascend_fa.adapters.base import token_mask_scope
from ascend_fa.adapters.hf import (
    fa_points,
    find_fa_modules,
    run_forwards,
    swapped_points,
)
from ascend_fa.adapters.placeholder import FA_BRANCHES, FA3QuantPlaceHolder
from ascend_fa.linear.engine import propagate_layer

from .distributed import all_reduce_observer, is_distributed
from .layerwise import (
    BeforeLayer,
    LayerCheckpoint,
    LayerProgress,
    decoder_stack,
    layerwise_supported,
    run_layerwise,
)
from .processor import FA3Observer, FA3Processor

__all__ = [
    "AttentionObserving",
    "CalibratedModel",
    "PointWrapper",
    "Ranges",
    "calibrate_linears",
    "calibrate_model",
    "calibrate_with_linears",
    "calibration_batches",
    "float_mode",
    "injected_points",
    "progress_bar",
    "run_forwards",
    "samples_bound",
    "tighten_max_samples",
    "tokenize_batch",
]

#: attention module name -> {"fa_q": (lo [H], hi [H]), ...}: calibrated ranges.
Ranges = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]
#: ``wrap(attn name, branch, observer point) -> module | None`` (None keeps it).
PointWrapper = Callable[[str, str, nn.Module], nn.Module | None]


def progress_bar(total: int, desc: str, unit: str = "sample") -> Any:
    """A progress bar that draws only on a terminal (plain logs stay clean)."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit=unit, leave=False, disable=not sys.stderr.isatty()
    )


def tokenize_batch(
    tokenizer: Any, texts: list[str], max_length: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """``input_ids``/``attention_mask`` ``[B, S]`` padded, and ``position_ids``
    counted over real tokens only, so a left-padded sample gets the same RoPE
    positions (hence the same Q and K) as when it is alone."""
    enc = tokenizer(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    mask = enc["attention_mask"]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": enc["input_ids"].to(device),
        "attention_mask": mask.to(device),
        "position_ids": position_ids.to(device),
    }


def calibration_batches(
    tokenizer: Any,
    texts: list[str],
    *,
    max_length: int,
    batch_size: int,
    device: torch.device | str = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """``texts`` in batches of ``batch_size``, tokenized by :func:`tokenize_batch`."""
    for i in range(0, len(texts), batch_size):
        yield tokenize_batch(tokenizer, texts[i : i + batch_size], max_length, device)


def samples_bound(
    fa_modules: dict[str, nn.Module], num_texts: int, max_length: int
) -> int | None:
    """Most samples any head can see: every text is cut to ``max_length`` tokens
    and a head sees ``D`` values per token (None when a point's ``D`` is unknown)."""
    dims = [
        getattr(child, "head_dim", None)
        for module in fa_modules.values()
        for branch, child in module.named_children()
        if branch in FA_BRANCHES
    ]
    if not dims or any(not isinstance(d, int) for d in dims):
        return None
    return num_texts * max_length * max(dims)


def tighten_max_samples(config: Any, bound: int | None) -> Any:
    """``config`` with every ``max_samples`` lowered to ``bound``.

    ``pooled`` keeps ``N_max - int(ratio * N_max) + 1`` values per head and tail, so
    the declared bound sets its cost per update. The calibration set bounds the
    samples exactly, so lowering the declared bound to it changes no result (the
    window is still exact) and keeps the retained tails short.
    """
    if bound is None:
        return config
    update: dict[str, Any] = {}
    if config.max_samples is not None and config.max_samples > bound:
        update["max_samples"] = bound
    for branch in FA_BRANCHES:
        over = getattr(config, branch)
        if over is not None and (over.max_samples or 0) > bound:
            update[branch] = over.model_copy(update={"max_samples": bound})
    return config.model_copy(update=update) if update else config


class CalibratedModel(NamedTuple):
    """What :func:`calibrate_model` returns, ``(processors, adapter, ranges)``; the
    model is left in fake-quant mode (:meth:`remove` restores it bit for bit).
    ``ranges[attn][fa_x] = (lo [H], hi [H])`` are the calibrated ranges."""

    processors: list[FA3Processor]
    adapter: Any
    ranges: Ranges

    def export_scales(self, model: nn.Module) -> dict[str, Any]:
        """``{attn: {"fa_q": (scale [H], offset [H]), ...}}`` of every processor."""
        scales: dict[str, Any] = {}
        for proc in self.processors:
            scales.update(proc.export_scales(model))
        return scales

    def remove(self, model: nn.Module) -> None:
        """Restore ``model`` exactly (no FA point, hook or wrapper left)."""
        for proc in self.processors:
            proc.remove(model, self.adapter)


@torch.no_grad()
def calibrate_model(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    *,
    recipe: Any,
    max_length: int = 512,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    wrap: PointWrapper | None = None,
    progress: bool = True,
    layerwise: bool = False,
    checkpoint: LayerCheckpoint | None = None,
    before_layer: BeforeLayer | None = None,
) -> CalibratedModel:
    """Inject, observe ``texts``, fake-quantize.

    ``wrap`` may put a module around each observer point for the duration of the
    forwards (the clip search keeps samples that way). Only one batch is alive at a
    time and only the last position's logits are computed.
    Call :func:`calibrate_linears` first to calibrate FA scales with quantized
    linears active (the attention then sees what the device sees).
    ``layerwise`` runs the batches layer-major (:mod:`.layerwise`: the same
    scales, bit for bit; each decoder layer runs once over all batches, which a
    streamed model reads once) where the model allows it; ``checkpoint`` (a
    resumable run, :mod:`.resume`) is restored before the first layer and saved
    after each. Progress is then one line per layer. ``before_layer`` (layer-major
    only; it forces ``layerwise``) runs before each decoder layer observes — the
    attention transforms fold there (:class:`~ascend_fa.transforms.attention.
    LayerwiseTransforms`); a model that cannot run layer-major raises ValueError.
    """
    adapter, processors, selected = _install_observers(
        model, recipe, len(texts), max_length
    )
    # A data-parallel rank runs its block of whole batches (the bound above counts
    # all texts: every rank's observers are configured alike).
    start, stop = parallel.batch_share(len(texts), batch_size)
    mine = texts[start:stop]
    batches = calibration_batches(
        tokenizer, mine, max_length=max_length, batch_size=batch_size, device=device
    )
    if before_layer is not None:
        if not layerwise_supported(model):
            raise ValueError(
                f"{type(model).__name__}: a before-layer step needs the layer-major "
                "pass, which this model's decoder stack does not allow"
            )
        layerwise = True
    layerwise = layerwise and layerwise_supported(model)
    bar: Any = None
    if progress and layerwise:
        batches = list(batches)
        stack = decoder_stack(model)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        bar = LayerProgress(len(stack) if stack is not None else 0, "attention", tokens)
    elif progress:
        bar = progress_bar(len(mine), "calibrate")
    swap = swapped_points(selected, wrap) if wrap else contextlib.nullcontext()
    try:
        with swap:
            if layerwise:
                run_layerwise(
                    model,
                    batches,
                    progress=bar,
                    checkpoint=checkpoint,
                    before_layer=before_layer,
                )
            else:
                run_forwards(model, batches, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    return _collect_ranges(model, processors, adapter)


def _install_observers(
    model: nn.Module, recipe: Any, texts: int, max_length: int
) -> tuple[Any, list[FA3Processor], dict[str, nn.Module]]:
    """Inject the recipe's FA points and put an observer at each (their sample
    caps tightened to ``texts`` x ``max_length`` tokens): ``(adapter,
    processors, selected attention modules)``."""
    from ascend_fa.adapters import get_adapter

    adapter = get_adapter(model)
    processors = [FA3Processor(item) for item in recipe.processors]
    for proc in processors:
        proc.preprocess(model, adapter)
    selected = find_fa_modules(model)
    if not selected:
        names = [n for n, _ in adapter.attention_modules(model)]
        for proc in processors:
            proc.remove(model, adapter)
        raise ValueError(
            f"the recipe selects no attention module (include/exclude match none of "
            f"the {len(names)} attention modules, e.g. {names[0] if names else '-'})"
        )
    bound = samples_bound(selected, texts, max_length)
    for proc in processors:
        proc.config = tighten_max_samples(proc.config, bound)
        proc.process(model)
    return adapter, processors, selected


def _collect_ranges(
    model: nn.Module, processors: list[FA3Processor], adapter: Any
) -> CalibratedModel:
    """Read every observer's range (all ranks' samples in a data-parallel run)
    and put the model in fake-quant mode."""
    ranges: Ranges = {}
    for name, module in find_fa_modules(model).items():
        entry = {}
        for branch, child in module.named_children():
            if isinstance(child, FA3Observer):
                if is_distributed():
                    # All ranks' samples before the ranges are read (reduced once;
                    # postprocess then finds it done).
                    all_reduce_observer(child.observer)
                lo, hi = child.observer.range()
                entry[branch] = (lo.detach().cpu(), hi.detach().cpu())
        ranges[name] = entry
    for proc in processors:
        proc.postprocess(model)
    return CalibratedModel(processors, adapter, ranges)


class AttentionObserving:
    """The FA pass riding on the linear pass: the recipe's observers (and the KV
    ``wrap``) installed before the linears are calibrated, fed only while each
    decoder layer, its linears quantized and placed, runs on the calibration
    batches (:data:`~ascend_fa.linear.Propagate`); every other forward of the
    linear pass (statistics, fallback, scan data) sees identity placeholders.

    Each observer then sees what the separate layer-major pass over the
    quantized model shows it (:mod:`.layerwise`: the same tensors in the same
    batch order, the padding mask set per batch), so the scales are the same bit
    for bit, without that pass's forward of the whole model. Valid where the
    layer-major pass is (:func:`~.layerwise.layerwise_supported`), for the
    layer-local fallback (the ``"kl"`` scan changes layers after they ran) and
    without a resumed linear pass (the observers of finished layers are not
    checkpointed). Use as a context manager around the linear pass, then
    :meth:`result`.
    """

    def __init__(
        self,
        model: nn.Module,
        recipe: Any,
        texts: int,
        max_length: int,
        wrap: PointWrapper | None = None,
    ) -> None:
        if not layerwise_supported(model):
            raise ValueError(
                f"{type(model).__name__}: the FA pass cannot ride on the linear "
                "pass (its decoder layers get different masks)"
            )
        self.model = model
        self.adapter, self.processors, selected = _install_observers(
            model, recipe, texts, max_length
        )
        #: the attention modules with FA points (the points change, not these)
        self._modules = selected
        self._stack = contextlib.ExitStack()
        if wrap is not None:
            self._stack.enter_context(swapped_points(selected, wrap))
        self._points = {
            (name, branch): point
            for name, module in selected.items()
            for branch, point in fa_points(module)
        }
        self._stack.enter_context(float_mode(model))
        self._calibrated: CalibratedModel | None = None

    def __enter__(self) -> AttentionObserving:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def propagate(self, index: int, layer: nn.Module, inputs: list[Any]) -> None:
        """Run decoder layer ``index`` on ``inputs`` with its observers in place."""
        del index  # the layer's attention modules are found under ``layer``
        inside = {id(m) for m in layer.modules()}
        here = {n: m for n, m in self._modules.items() if id(m) in inside}
        with swapped_points(here, lambda n, b, _p: self._points[(n, b)]):
            propagate_layer(
                layer, inputs, scope=lambda mask: token_mask_scope(self.model, mask)
            )

    def result(self) -> CalibratedModel:
        """The observers' ranges; the model left in fake-quant mode (as
        :func:`calibrate_model` leaves it)."""
        if self._calibrated is None:
            self._stack.close()
            self._calibrated = _collect_ranges(
                self.model, self.processors, self.adapter
            )
        return self._calibrated


def calibrate_linears(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    config: Any,
    *,
    max_length: int = 512,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    progress: bool = True,
    checkpoint: Any = None,
    prepare_layer: Callable[[int], None] | None = None,
    attention: AttentionObserving | None = None,
) -> Any:
    """Quantize ``model``'s linears on ``texts`` (:mod:`ascend_fa.linear`): all
    texts in padded batches for the layer-by-layer calibration, and the first
    ``config.scan_samples`` texts cut to ``config.scan_tokens`` tokens as the scan
    data of the fallback. ``checkpoint``: a
    :class:`~ascend_fa.linear.LinearCheckpoint` (a resumable run). Returns the
    :class:`~ascend_fa.linear.LinearResult`.

    A data-parallel rank runs its block of whole batches (the statistics are
    reduced per layer) and the whole scan data (every rank then takes the same
    fallback decisions). ``prepare_layer(i)`` is called before decoder layer ``i``
    is calibrated (a streamed model loads it: a rank without batches runs none
    of its forwards). ``attention`` (:class:`AttentionObserving`, installed on
    ``model`` for the same ``texts``): the FA pass observes inside this one, as
    each layer's quantized outputs are computed; read it with its ``result()``
    after."""
    from ascend_fa import linear as linear_pkg

    def batches(items: list[str], length: int) -> list[dict[str, torch.Tensor]]:
        return list(
            calibration_batches(
                tokenizer,
                items,
                max_length=length,
                batch_size=batch_size,
                device=device,
            )
        )

    scan = (
        batches(texts[: config.scan_samples], min(config.scan_tokens, max_length))
        if config.fallback != 0
        else []
    )
    layers = int(model.config.num_hidden_layers)
    start, stop = parallel.batch_share(len(texts), batch_size)
    calib = batches(texts[start:stop], max_length)
    bar = None
    if progress:
        tokens = sum(int(b["attention_mask"].sum()) for b in calib)
        bar = LayerProgress(layers, "linears", tokens)
    try:
        return linear_pkg.calibrate_linears(
            model,
            calib,
            config,
            scan_batches=scan,
            progress=bar,
            keep_floats=False,
            checkpoint=checkpoint,
            prepare_layer=prepare_layer,
            propagate=attention.propagate if attention is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()


@contextlib.contextmanager
def float_mode(model: nn.Module) -> Iterator[None]:
    """Temporarily put an identity placeholder at every FA point."""
    with swapped_points(
        find_fa_modules(model),
        lambda _n, branch, child: FA3QuantPlaceHolder(
            branch, getattr(child, "num_heads", 1)
        ),
    ):
        yield


def calibrate_with_linears(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    config: Any,
    *,
    recipe: Any,
    max_length: int = 512,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> tuple[Any, CalibratedModel, float]:
    """The linears quantized (``config``: a :class:`~ascend_fa.linear.
    LinearConfig`), then the FA scales observed on them, as ``calibrate`` runs
    both: the FA pass rides on the linear pass (:class:`AttentionObserving`)
    where it can (criterion ``"layer"``, a model whose layers share one mask),
    else runs after it. Returns ``(LinearResult, CalibratedModel, seconds of a
    separate FA pass: 0.0 when it rode)``; the model is left in fake-quant
    mode."""
    kw: dict[str, Any] = dict(
        max_length=max_length, batch_size=batch_size, device=device, progress=progress
    )
    if config.criterion == "layer" and layerwise_supported(model):
        with AttentionObserving(model, recipe, len(texts), max_length) as observing:
            result = calibrate_linears(
                model, tokenizer, texts, config, attention=observing, **kw
            )
        return result, observing.result(), 0.0
    result = calibrate_linears(model, tokenizer, texts, config, **kw)
    t = time.perf_counter()
    calibrated = calibrate_model(model, tokenizer, texts, recipe=recipe, **kw)
    return result, calibrated, time.perf_counter() - t
