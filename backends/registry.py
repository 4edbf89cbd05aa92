"""Backend registry and selection.

Built-in backends are registered by dotted path and imported only when asked for;
third-party backends come from the entry-point group ``ascend_fa.backends``
(``name = "package.module:BackendClass"``).

Selection rules of :func:`get_backend`:

1. an explicit ``name`` wins;
2. else the environment variable ``ASCEND_FA_BACKEND`` if set;
3. else the available backend with the highest ``priority`` (npu > cuda > cpu).

An unknown or unusable name raises a ``ValueError`` that lists every backend and
why it is or is not usable.
"""

from __future__ import annotations

import functools
import importlib
import threading
from dataclasses import dataclass
from importlib import metadata

from ..atb_ops import settings
from .base import AttentionSpec, Availability, Backend, CapabilityError

__all__ = [
    "ENV_VAR",
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "register_backend",
    "list_backends",
    "get_backend",
    "select_backend",
    "backend_for_device",
    "clear_backend_cache",
]

ENV_VAR = "ASCEND_FA_BACKEND"
ENTRY_POINT_GROUP = "ascend_fa.backends"

_BUILTIN: dict[str, str] = {
    "cpu": "ascend_fa.backends.cpu:CPUBackend",
    "cuda": "ascend_fa.backends.cuda:CUDABackend",
    "npu": "ascend_fa.backends.npu:NPUBackend",
}
_EXTRA: dict[str, str | type[Backend]] = {}
_INSTANCES: dict[str, Backend] = {}
_LOCK = threading.RLock()


@dataclass(frozen=True)
class BackendInfo:
    """One row of :func:`list_backends`."""

    name: str
    source: str
    available: bool
    reason: str
    priority: int
    backend_cls: type[Backend] | None


def register_backend(name: str, target: str | type[Backend]) -> None:
    """Register a backend class (or ``"module:Class"`` path) under ``name``.

    Used by tests and by code that cannot ship an entry point. Overrides a plugin of
    the same name; built-in names cannot be replaced.
    """
    if name in _BUILTIN:
        raise ValueError(f"register_backend: {name!r} is a built-in backend name")
    with _LOCK:
        _EXTRA[name] = target
        _INSTANCES.pop(name, None)
    clear_backend_cache()


def _entry_points() -> dict[str, str]:
    found: dict[str, str] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _BUILTIN:
            found[ep.name] = ep.value
    return found


def _targets() -> dict[str, tuple[str, str | type[Backend]]]:
    targets: dict[str, tuple[str, str | type[Backend]]] = {
        n: ("built-in", p) for n, p in _BUILTIN.items()
    }
    for name, value in _entry_points().items():
        targets[name] = (f"entry point {ENTRY_POINT_GROUP}", value)
    for name, value in _EXTRA.items():
        targets[name] = ("registered", value)
    return targets


def _load_class(target: str | type[Backend]) -> type[Backend]:
    if isinstance(target, type):
        cls = target
    else:
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)
        cls = functools.reduce(getattr, attr.split("."), module) if attr else module
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{target!r} is not a subclass of ascend_fa.backends.Backend")
    return cls


def _probe(name: str, source: str, target: str | type[Backend]) -> BackendInfo:
    try:
        cls = _load_class(target)
    except Exception as exc:  # a broken plugin is reported, not fatal
        return BackendInfo(
            name, source, False, f"cannot load {target!r}: {exc}", -1, None
        )
    try:
        avail = cls.is_available()
    except Exception as exc:
        avail = Availability(
            False, f"availability check raised {type(exc).__name__}: {exc}"
        )
    return BackendInfo(name, source, bool(avail), avail.reason, cls.priority, cls)


def list_backends() -> list[BackendInfo]:
    """Every known backend with whether it is usable here and why (not)."""
    return [_probe(n, src, t) for n, (src, t) in sorted(_targets().items())]


def _describe(infos: list[BackendInfo]) -> str:
    lines = []
    for info in infos:
        state = "available" if info.available else f"unavailable: {info.reason}"
        lines.append(f"  - {info.name} ({info.source}): {state}")
    return "\n".join(lines)


def _instance(info: BackendInfo) -> Backend:
    with _LOCK:
        inst = _INSTANCES.get(info.name)
        if inst is None or type(inst) is not info.backend_cls:
            assert info.backend_cls is not None
            inst = info.backend_cls()
            _INSTANCES[info.name] = inst
        return inst


def get_backend(name: str | None = None) -> Backend:
    """The backend to use: explicit ``name``, else ``$ASCEND_FA_BACKEND``, else the
    available backend with the highest priority (npu, then cuda, then cpu)."""
    chosen = name if name is not None else settings.get(ENV_VAR)
    infos = list_backends()
    if chosen is not None:
        chosen = chosen.strip().lower()
        by_name = {i.name: i for i in infos}
        info = by_name.get(chosen)
        origin = "requested" if name is not None else f"set by {ENV_VAR}"
        if info is None:
            raise ValueError(
                f"unknown backend {chosen!r} ({origin}); known backends:\n"
                f"{_describe(infos)}"
            )
        if not info.available:
            raise ValueError(
                f"backend {chosen!r} ({origin}) is not usable here: {info.reason}\n"
                f"all backends:\n{_describe(infos)}"
            )
        return _instance(info)
    usable = sorted(
        (i for i in infos if i.available), key=lambda i: (-i.priority, i.name)
    )
    if not usable:
        raise ValueError(f"no usable backend:\n{_describe(infos)}")
    return _instance(usable[0])


def backend_for_device(device: str | object) -> Backend:
    """The backend that runs tensors on ``device`` (a torch.device or its type).

    Honors ``$ASCEND_FA_BACKEND`` when it names a backend of that device type.
    """
    device_type = getattr(device, "type", None) or str(device).split(":")[0]
    forced = settings.get(ENV_VAR)
    if forced:
        backend = get_backend(forced)
        if backend.device_type == device_type:
            return backend
    infos = [
        i
        for i in list_backends()
        if i.backend_cls is not None and i.backend_cls.device_type == device_type
    ]
    usable = sorted(
        (i for i in infos if i.available), key=lambda i: (-i.priority, i.name)
    )
    if not usable:
        raise ValueError(
            f"no usable backend for tensors on {device_type!r}:\n"
            f"{_describe(list_backends())}"
        )
    return _instance(usable[0])


@functools.lru_cache(maxsize=256)
def _select_cached(spec: AttentionSpec, name: str | None) -> Backend:
    if name is not None:
        backend = get_backend(name)
        backend.require(spec)
        return backend
    report = []
    for info in sorted(list_backends(), key=lambda i: (-i.priority, i.name)):
        if not info.available:
            report.append(f"  - {info.name}: unavailable: {info.reason}")
            continue
        backend = _instance(info)
        reasons = backend.unsupported_reasons(spec)
        if not reasons:
            return backend
        report.append(f"  - {info.name}: " + "; ".join(reasons))
    raise CapabilityError(
        "any", spec, report, f"no backend can run {spec}:\n" + "\n".join(report)
    )


def select_backend(spec: AttentionSpec, name: str | None = None) -> Backend:
    """The backend for ``spec`` (cached on the hashable spec).

    With ``name`` (or ``$ASCEND_FA_BACKEND``) that backend must support the spec;
    otherwise the highest-priority usable backend that supports it. When none does,
    the :class:`~ascend_fa.backends.base.CapabilityError` (a ``ValueError``) lists
    every backend with its reasons.
    """
    chosen = name if name is not None else settings.get(ENV_VAR)
    return _select_cached(spec, chosen)


def clear_backend_cache() -> None:
    """Forget cached selections (after registering a backend or changing devices)."""
    _select_cached.cache_clear()
