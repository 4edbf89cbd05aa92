"""Data-parallel calibration over ``torch.distributed``: process group, sample split.

``torchrun --nproc_per_node N -m ascend_fa calibrate ...`` starts N processes with
``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` in their environment;
:func:`process_group` joins them (gloo for the CPU, nccl for CUDA, hccl for the
NPU), :func:`batch_share` gives each rank a contiguous block of whole calibration
batches in global order, and the calibration code reduces its statistics so that
every rank takes the decisions one process would take on all batches (see
:mod:`ascend_fa.calibration.distributed` and :mod:`ascend_fa.linear.parallel`).

Why whole batches: a batch is padded to its longest sample, so a sample's tensors
depend on the batch it is in. Splitting by batches, in global order, makes every
batch a rank runs the very batch one process runs (the same bits); only the
reductions of statistics remain, and those are exact.

A process group that is already initialised (a caller that set it up itself) is
used as it is and left open; one set up here is destroyed on leaving, after a
last barrier: every rank leaves once all ranks are done (rank 0 has written).
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.distributed as dist

from ascend_fa import settings
from ascend_fa.errors import InputError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "all_gather_objects",
    "batch_share",
    "comm_backend",
    "is_active",
    "joined",
    "launch_rank",
    "launched",
    "rank_zero_first",
    "process_group",
    "rank",
    "world_size",
]

#: Seconds a collective waits for the other ranks before the run fails (no hang
#: when a rank dies); ``ASCEND_FA_DIST_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 1800
TIMEOUT_ENV = "ASCEND_FA_DIST_TIMEOUT"
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
#: set once :func:`process_group` has joined a launcher's group in this process
_JOINED: list[bool] = []


def joined() -> bool:
    """True once this process joined a launcher's process group (errors after that
    may be rank-specific; before it, every rank finds the same input errors)."""
    return bool(_JOINED)


def launched() -> bool:
    """True when a launcher (torchrun) started this process as one of several
    (``WORLD_SIZE`` > 1 in the environment)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return True  # a malformed value: process_group says what is wrong


def launch_rank() -> int:
    """This process's ``RANK`` in a launcher's group (0 when not launched as one of
    several): valid also before the group is joined or after it is left."""
    if not launched():
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def is_active() -> bool:
    """True when a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_active() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_active() else 1


def comm_backend(device: torch.device) -> str:
    """The collective backend for ``device``'s type: gloo (cpu), nccl (cuda),
    hccl (npu)."""
    backend = _BACKENDS.get(device.type)
    if backend is None:
        raise InputError(
            f"data-parallel calibration on device {device.type!r}: no collective "
            f"backend (supported: {', '.join(_BACKENDS)})"
        )
    return backend


def _timeout() -> datetime.timedelta:
    try:
        seconds = float(settings.get(TIMEOUT_ENV))
    except settings.SettingError as exc:
        raise InputError(str(exc)) from None
    return datetime.timedelta(seconds=seconds)


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    try:
        value = int(raw) if raw is not None else -1
    except ValueError:
        value = -1
    if value < 0:
        raise InputError(
            f"data-parallel setup: {name}={raw!r} in the environment; launch with "
            "torchrun --nproc_per_node N -m ascend_fa calibrate ..."
        )
    return value


@contextmanager
def process_group(device: torch.device) -> Iterator[torch.device]:
    """Join the launcher's process group for ``device`` when :func:`launched`
    (yields the device of this rank: ``LOCAL_RANK``'s accelerator); otherwise, or
    when a group is already initialised, yield ``device`` and do nothing.

    Raises :class:`~ascend_fa.errors.InputError` (one line) for a bad setup: a
    missing or malformed ``RANK`` / ``WORLD_SIZE``, a device type without a
    collective backend, or a rendezvous that fails.
    """
    if not launched() or (dist.is_available() and dist.is_initialized()):
        yield device
        return
    if not dist.is_available():
        raise InputError("data-parallel setup: this torch has no torch.distributed")
    world = _env_int("WORLD_SIZE")
    me = _env_int("RANK")
    if me >= world:
        raise InputError(f"data-parallel setup: RANK={me} >= WORLD_SIZE={world}")
    backend = comm_backend(device)
    if device.type != "cpu":
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        device = torch.device(device.type, local)
        getattr(torch, device.type).set_device(device)
    timeout = _timeout()
    try:
        dist.init_process_group(backend, rank=me, world_size=world, timeout=timeout)
    except (RuntimeError, ValueError, OSError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise InputError(
            f"data-parallel setup ({backend}, rank {me} of {world}) failed: {text}"
        ) from exc
    _JOINED.append(True)
    finished = False
    try:
        if me == 0:
            print(
                f"data-parallel calibration: {world} ranks ({backend}), rank 0 "
                "writes the artifact",
                flush=True,
            )
        yield device
        finished = True
    finally:
        _leave(finished)


def _leave(finished: bool) -> None:
    """Tear down this process's group in step with the other ranks.

    A rank that finished waits at one last barrier for the others (rank 0 is then
    done writing), so no rank destroys its gloo pairs while a peer still works; a
    barrier that fails means another rank failed (its own error is the one to
    read). The group is destroyed and collected while the interpreter is fully
    alive: gloo's worker threads torn down during interpreter finalization abort
    the process (``terminate called without an active exception``, SIGABRT;
    pytorch/pytorch#179291 describes the finalization case; seen here as a rank
    aborting after its work was done while rank 0 still wrote).
    """
    try:
        if finished:
            with suppress(RuntimeError, ValueError):
                dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()


def batch_share(num_items: int, batch_size: int) -> tuple[int, int]:
    """``(start, stop)``: this rank's items, a contiguous block of whole batches of
    ``batch_size`` in global order. The first ``num_batches % world`` ranks get one
    batch more; a rank may get none (``start == stop``). ``(0, num_items)`` without
    a process group."""
    if not is_active():
        return 0, num_items
    batches = -(-num_items // batch_size)
    world, me = world_size(), rank()
    per, extra = divmod(batches, world)
    first = me * per + min(me, extra)
    count = per + (1 if me < extra else 0)
    return (
        min(first * batch_size, num_items),
        min((first + count) * batch_size, num_items),
    )


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` without a process group).
    Objects travel pickled on the CPU (gloo) or the rank's device."""
    if not is_active():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


@contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the block first, the other ranks after it finished (a shared
    cache is then written once, by rank 0). Without a process group: just run."""
    if not is_active():
        yield
        return
    if rank() != 0:
        dist.barrier()
    yield
    if rank() == 0:
        dist.barrier()
