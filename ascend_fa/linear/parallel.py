"""Exact data-parallel reduction of one layer's linear input statistics.

In a data-parallel run (:mod:`ascend_fa.parallel`) each rank observes a contiguous
block of whole calibration batches. :class:`~.search.InputStats` holds, per group,
the per-channel minimum and maximum, the token count and a row sample whose random
picks come from one generator drawn once per update, in update order. One process
seeing all batches draws for rank 0's batches first, then rank 1's, and so on; so:

1. before observing, every rank learns how many rows each update of every rank
   gets (a counting forward, gathered) and draws what the earlier ranks' updates
   draw (:meth:`~.search.InputStats.skip`);
2. it observes its own batches (its draws are now those of one process);
3. it draws what the later ranks' updates draw, and adopts the union: the kept
   row sets of all ranks in rank order (= global update order), per-channel
   minimum / maximum over the ranks (order-independent, hence exact) and the
   summed token count.

Every rank then holds, bit for bit, the statistics and generator state of one
process, and decides the group (smoothing, range, fallback) as that process does.
"""

from __future__ import annotations

import torch

from ascend_fa import parallel

from .search import InputStats

__all__ = ["StatsSync"]


class StatsSync:
    """Makes a rank's statistics of one layer those of all ranks' batches."""

    def __init__(self) -> None:
        self._counts: list[dict[str, list[int]]] = []

    def before(
        self, stats: dict[str, InputStats], counts: dict[str, list[int]]
    ) -> None:
        """Gather every rank's per-update row ``counts`` and draw the earlier
        ranks' picks on ``stats`` (call before this rank's updates)."""
        self._counts = parallel.all_gather_objects(counts)
        for name, st in stats.items():
            for theirs in self._counts[: parallel.rank()]:
                for rows in theirs[name]:
                    st.skip(rows)

    def after(self, stats: dict[str, InputStats]) -> None:
        """Draw the later ranks' picks, then adopt the union of all ranks' state."""
        for name, st in stats.items():
            for theirs in self._counts[parallel.rank() + 1 :]:
                for rows in theirs[name]:
                    st.skip(rows)
        mine = {
            name: (st.parts, st.cmin, st.cmax, st.tokens, st.bounds)
            for name, st in stats.items()
        }
        every = parallel.all_gather_objects(mine)
        for name, st in stats.items():
            sides = [theirs[name] for theirs in every]
            cmin, cmax = sides[0][1], sides[0][2]
            for _parts, lo, hi, _tokens, _bounds in sides[1:]:
                cmin, cmax = torch.minimum(cmin, lo), torch.maximum(cmax, hi)
            st.adopt(
                [p for parts, *_ in sides for p in parts],
                cmin,
                cmax,
                sum(side[3] for side in sides),
                [b for *_, bounds in sides for b in bounds],
            )
        self._counts = []
