"""The ``Backend`` interface: what a device can do, stated as data.

A backend is a stateless singleton. Its class attributes say what it supports
(:class:`Capabilities`); :meth:`Backend.unsupported_reasons` turns a hashable
:class:`AttentionSpec` into the list of reasons it cannot run it (empty list: it can).
Selection (see :mod:`ascend_fa.backends.registry`) only ever reads these answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..atb_ops import FP8_KV_DTYPE, c0, nz_cache_shape
from ..atb_ops.attention import PagedAttentionInfo

__all__ = [
    "CapabilityError",
    "Availability",
    "Capabilities",
    "AttentionSpec",
    "Backend",
    "KV_LAYOUTS",
    "ATTENTION_MODES",
    "ATTENTION_OPS",
    "LINEAR_OPS",
    "LinearSpec",
    "attention_spec",
    "cache_write_spec",
    "linear_spec",
]

#: Paged KV-cache layouts:
#: ``nz`` ``[NB, Hkv*D//C0, BS, C0]``, ``nd`` ``[NB, BS, Hkv, D]``.
KV_LAYOUTS = ("nz", "nd")

#: Attention modes: float caches; int8 KV with float query ("antiquant", per-head
#: or per-channel C8 scales); FAQuant (int8 Q, K, V, GQA/MHA); FAKQuant (int8
#: absorbed query and latent, DeepSeek MLA); FP8 E4M3 KV with float query (vLLM).
ATTENTION_MODES = ("float", "int8_kv", "faquant", "fakquant", "fp8_kv")


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and why not. Truthy when available."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. ``None`` in a field means "any"."""

    query_dtypes: frozenset[torch.dtype] = frozenset(
        {torch.float16, torch.bfloat16, torch.float32}
    )
    cache_dtypes: frozenset[torch.dtype] = frozenset(
        {torch.float16, torch.bfloat16, torch.float32, torch.int8, FP8_KV_DTYPE}
    )
    layouts: frozenset[str] = frozenset(KV_LAYOUTS)
    modes: frozenset[str] = frozenset(ATTENTION_MODES)
    head_dims: frozenset[int] | None = None
    #: Explicit block sizes, or None for "any multiple of the NZ row alignment".
    block_sizes: frozenset[int] | None = None
    supports_offsets: bool = False


@dataclass(frozen=True)
class AttentionSpec:
    """A hashable description of one attention / cache call, used for selection.

    ``op`` is one of ``"cache_write"``, ``"decode"``, ``"prefill"``, ``"mla_decode"``,
    ``"mla_prefill"``; ``mode`` one of :data:`ATTENTION_MODES`.
    """

    op: str = "decode"
    mode: str = "float"
    query_dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype = torch.bfloat16
    head_dim: int = 128
    num_heads: int = 1
    num_kv_heads: int = 1
    block_size: int = 128
    layout: str = "nz"
    device_type: str = "cpu"
    has_offsets: bool = False
    extra: tuple[tuple[str, object], ...] = field(default=())


#: Operations a spec can describe (``AttentionSpec.op``).
ATTENTION_OPS = (
    "cache_write",
    "mla_cache_write",
    "decode",
    "prefill",
    "mla_decode",
    "mla_prefill",
)


def attention_spec(
    op: str, info: PagedAttentionInfo, device_type: str
) -> AttentionSpec:
    """The spec of a validated attention call (``info`` from ``check_*_attention``).

    MLA specs carry ``num_kv_heads=1``, ``head_dim=R`` and ``("rope_dim", Dr)`` in
    ``extra``.
    """
    if op not in ATTENTION_OPS:
        raise ValueError(
            f"attention_spec: op must be one of {ATTENTION_OPS}, got {op!r}"
        )
    extra = (("rope_dim", info.rope_dim),) if info.rope_dim else ()
    return AttentionSpec(
        op=op,
        mode=info.mode,
        query_dtype=info.query_dtype,
        cache_dtype=info.cache_dtype,
        head_dim=info.head_dim,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        block_size=info.block_size,
        layout=info.layout,
        device_type=device_type,
        extra=extra,
    )


def cache_write_spec(
    *,
    key_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    layout: str,
    device_type: str,
    mla: bool = False,
    rope_dim: int = 0,
) -> AttentionSpec:
    """The spec of a cache write (``reshape_and_cache`` / ``reshape_and_cache_mla``)."""
    if cache_dtype == FP8_KV_DTYPE:
        mode = "fp8_kv"
    elif cache_dtype == torch.int8:
        mode = "fakquant" if mla else "int8_kv"
    else:
        mode = "float"
    return AttentionSpec(
        op="mla_cache_write" if mla else "cache_write",
        mode=mode,
        query_dtype=key_dtype,
        cache_dtype=cache_dtype,
        head_dim=head_dim,
        num_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        layout=layout,
        device_type=device_type,
        extra=(("rope_dim", rope_dim),) if mla else (),
    )


#: W8A8 linear ops a :class:`LinearSpec` can describe (``ascend_fa::<op>``).
LINEAR_OPS = (
    "quantize_static",
    "dynamic_quant",
    "quant_matmul",
    "quant_matmul_dynamic",
)


@dataclass(frozen=True)
class LinearSpec:
    """A hashable description of one W8A8 linear op call (the ops of
    ``atb_ops/linear.py``), checked against a device's capability table.

    ``mode`` is ``"static"`` (``quantize_static``, ``quant_matmul``) or
    ``"dynamic"``; ``input_dtype`` is the float activation dtype of a quantize op,
    ``out_dtype`` / ``scale_dtype`` the output and ``deq_scale`` / ``weight_scale``
    dtypes of a matmul; ``k`` / ``n`` the reduction and output widths;
    ``scale_exact`` whether a quantize op's scale and offset keep their values in
    the dtype the device takes them in. ``layout`` is always ``"nd"``.
    """

    op: str
    mode: str
    input_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    scale_dtype: torch.dtype | None = None
    k: int = 0
    n: int = 0
    scale_exact: bool = True
    layout: str = "nd"
    device_type: str = "cpu"


def linear_spec(op: str, device_type: str, **fields) -> LinearSpec:
    """The spec of a validated linear op call; ``mode`` follows from ``op``."""
    if op not in LINEAR_OPS:
        raise ValueError(f"linear_spec: op must be one of {LINEAR_OPS}, got {op!r}")
    mode = "dynamic" if op in ("dynamic_quant", "quant_matmul_dynamic") else "static"
    return LinearSpec(op=op, mode=mode, device_type=device_type, **fields)


class CapabilityError(ValueError):
    """A backend cannot run a spec; ``reasons`` lists why (one line each)."""

    def __init__(
        self,
        backend: str,
        spec: AttentionSpec,
        reasons: list[str],
        message: str | None = None,
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.reasons = list(reasons)
        super().__init__(
            message
            or f"backend {backend!r} cannot run {spec.op} ({spec.mode}):\n"
            + "\n".join(f"  - {r}" for r in self.reasons)
        )


class Backend:
    """Base class of every backend.

    Subclasses set ``name``, ``device_type``, ``priority`` (higher wins automatic
    selection) and ``capabilities``, and override :meth:`is_available`. They may
    extend :meth:`unsupported_reasons` with device-specific constraints.

    A backend runs nothing itself: every call goes public API ->
    ``torch.ops.ascend_fa.<op>`` -> the kernel registered for the tensors' dispatch
    key (the PyTorch reference kernels by default; a device backend registers its
    own for its key, as :mod:`ascend_fa.backends.npu` does for PrivateUse1). The
    backend answers what it can run and how caches are laid out.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    capabilities: ClassVar[Capabilities] = Capabilities()
    description: ClassVar[str] = ""

    # -- availability ---------------------------------------------------------------
    @classmethod
    def is_available(cls) -> Availability:
        """Whether this backend can run in this process (with the reason if not)."""
        return Availability(True)

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    # -- capability checks --------------------------------------------------------
    def unsupported_reasons(self, spec: AttentionSpec) -> list[str]:
        """Every reason this backend cannot run ``spec``; empty when it can."""
        caps = self.capabilities
        reasons: list[str] = []
        if spec.device_type != self.device_type:
            reasons.append(
                f"tensors are on {spec.device_type!r}, backend runs on "
                f"{self.device_type!r}"
            )
        if spec.mode not in caps.modes:
            reasons.append(
                f"mode {spec.mode!r} not supported (supports {sorted(caps.modes)})"
            )
        if spec.query_dtype not in caps.query_dtypes:
            reasons.append(
                f"query dtype {spec.query_dtype} not supported "
                f"(supports {_dtypes(caps.query_dtypes)})"
            )
        if spec.cache_dtype not in caps.cache_dtypes:
            reasons.append(
                f"cache dtype {spec.cache_dtype} not supported "
                f"(supports {_dtypes(caps.cache_dtypes)})"
            )
        if spec.layout not in caps.layouts:
            reasons.append(
                f"KV layout {spec.layout!r} not supported "
                f"(supports {sorted(caps.layouts)})"
            )
        if caps.head_dims is not None and spec.head_dim not in caps.head_dims:
            reasons.append(
                f"head_dim {spec.head_dim} not supported "
                f"(supports {sorted(caps.head_dims)})"
            )
        if caps.block_sizes is not None and spec.block_size not in caps.block_sizes:
            reasons.append(
                f"block_size {spec.block_size} not supported "
                f"(supports {sorted(caps.block_sizes)})"
            )
        row_align = 32 if spec.cache_dtype in (torch.int8, FP8_KV_DTYPE) else 16
        if spec.block_size % row_align:
            reasons.append(
                f"block_size {spec.block_size} is not a multiple of {row_align} "
                f"for a {spec.cache_dtype} cache"
            )
        if spec.has_offsets and not caps.supports_offsets:
            reasons.append("non-zero quantization offsets are not supported")
        if spec.num_kv_heads <= 0 or spec.num_heads % max(spec.num_kv_heads, 1):
            reasons.append(
                f"num_heads {spec.num_heads} is not a multiple of "
                f"num_kv_heads {spec.num_kv_heads}"
            )
        if spec.layout == "nz" and (spec.num_kv_heads * spec.head_dim) % c0(
            spec.cache_dtype
        ):
            reasons.append(
                f"Hkv*D = {spec.num_kv_heads * spec.head_dim} is not a multiple "
                f"of C0 = {c0(spec.cache_dtype)} for an NZ {spec.cache_dtype} cache"
            )
        return reasons

    def supports(self, spec: AttentionSpec) -> bool:
        return not self.unsupported_reasons(spec)

    # -- cache allocation ---------------------------------------------------------
    def kv_cache_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        layout: str = "nz",
        mode: str | None = None,
    ) -> tuple[int, ...]:
        """Shape of one paged K or V cache on this backend.

        ``nz``: ``[NB, Hkv*D // C0, BS, C0]``; ``nd``: ``[NB, BS, Hkv, D]``.
        ``mode`` lets a backend choose a layout per attention mode (the NPU FAQuant
        op takes ND).
        """
        if layout not in KV_LAYOUTS:
            raise ValueError(
                f"kv_cache_shape: layout must be one of {KV_LAYOUTS}, got {layout!r}"
            )
        if layout == "nz":
            return nz_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def preferred_layout(self, mode: str, *, mla: bool = False) -> str:
        """KV layout this backend wants for ``mode`` (NZ unless the device says
        otherwise); ``mla`` asks for the MLA latent / rope caches."""
        return "nz"

    def require(self, spec: AttentionSpec) -> None:
        """Raise :class:`CapabilityError` listing every reason this backend cannot
        run ``spec``."""
        reasons = self.unsupported_reasons(spec)
        if reasons:
            raise CapabilityError(self.name, spec, reasons)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} device={self.device_type!r}>"


def _dtypes(dtypes: frozenset[torch.dtype]) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in dtypes)
