"""Reduce observer state across ``torch.distributed`` ranks, exactly.

Calibration data is split across ranks; each rank observes its share, and once at
the end (in :meth:`FA3Processor.postprocess`, never per forward) every observer is
reduced so that all ranks hold the state a single process would have reached:

============================  ==================================================
state                         reduction
============================  ==================================================
``num_samples`` ``[H]``        SUM
``lo`` / ``hi`` ``[H]``        MIN / MAX (``minmax`` and ``union``: min and max are
                              order-independent, so the result is bit-equal)
``low_tail`` / ``high_tail``   all-gather ``[world, H, k_max]``, keep the ``k_max``
``[H, k_max]`` (``pooled``)    smallest / largest: the tails of the union of all
                              ranks' samples, hence the same exact window
============================  ==================================================

Every rank must call with observers in the same order and configuration (checked).
An observer is reduced once: a second call is a no-op (``reduced_ranks`` records it),
so the calibration loop may reduce before reading the ranges and
:meth:`FA3Processor.postprocess` after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .observers import PerHeadObserver

__all__ = ["all_reduce_observer", "is_distributed"]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def _comm_device(group: object | None) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu")
    return torch.device("cpu")


@torch.no_grad()
def all_reduce_observer(
    observer: PerHeadObserver, group: object | None = None
) -> PerHeadObserver:
    """Make ``observer`` hold the state of all ranks' samples (in place; returns it).

    A no-op when ``torch.distributed`` is not initialised. Raises ``ValueError`` if
    ranks disagree on the configuration or the total exceeds ``max_samples``.
    """
    if not is_distributed():
        return observer
    world = dist.get_world_size(group)
    if world == 1 or observer.reduced_ranks > 1:
        return observer
    metas: list[object] = [None] * world
    dist.all_gather_object(metas, (observer.name, observer.meta()), group=group)
    me = dist.get_rank(group)
    for rank, meta in enumerate(metas):
        if meta != metas[me]:
            raise ValueError(
                f"all_reduce_observer: rank {rank} reduces {meta} but rank {me} "
                f"reduces {metas[me]}; every rank must reduce the same observers "
                "(name and settings) in the same order"
            )
    home = observer.num_samples.device
    dev = _comm_device(group)
    counts = observer.num_samples.to(dev).clone()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    total = int(counts[0])
    if observer.max_samples is not None and total > observer.max_samples:
        raise ValueError(
            f"all_reduce_observer: observer {observer.name!r} saw {total} samples per "
            f"head over {world} ranks, more than max_samples={observer.max_samples}"
        )
    if observer._keeps_tails():
        k = observer.k_max
        lows = [torch.empty_like(observer.low_tail, device=dev) for _ in range(world)]
        highs = [torch.empty_like(observer.high_tail, device=dev) for _ in range(world)]
        dist.all_gather(lows, observer.low_tail.to(dev).contiguous(), group=group)
        dist.all_gather(highs, observer.high_tail.to(dev).contiguous(), group=group)
        observer.low_tail = torch.topk(
            torch.cat(lows, dim=1), k, dim=1, largest=False, sorted=True
        ).values.to(home)
        observer.high_tail = (
            torch.topk(torch.cat(highs, dim=1), k, dim=1, largest=True, sorted=True)
            .values.flip(1)
            .to(home)
        )
    else:
        lo = observer.lo.to(dev).clone()
        hi = observer.hi.to(dev).clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        observer.lo, observer.hi = lo.to(home), hi.to(home)
    observer.num_samples = counts.to(home)
    observer.reduced_ranks = world
    return observer
