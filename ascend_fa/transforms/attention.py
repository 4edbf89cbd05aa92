"""Exact attention transforms folded into the weights before FA calibration.

Static per-head INT8 (FAQuant: one scale per head for Q, K and V) loses accuracy
where a few channels of a head carry most of its range. Two transforms move that
range offline, in the float weights, so the device runs its usual kernels with its
usual static ``[H, 1]`` scales and the float model computes the same function:

``v-rotation``
    Each KV head's V is rotated by an orthogonal ``R_h`` ``[D, D]``: a Hadamard
    matrix with seeded random signs (:func:`~.hadamard.random_hadamard`), which
    spreads an outlier channel over the whole head. Folded as
    ``v_proj.weight[h] <- R_hᵀ v_proj.weight[h]`` (and its bias) and
    ``o_proj.weight[:, i] <- o_proj.weight[:, i] R_h`` for every query head ``i``
    of KV group ``h``: attention mixes V over tokens only, so ``P (V R) Rᵀ = P V``.
``qk-smoothing``
    A per-channel factor ``s > 0`` with ``Q' = Q / s`` and ``K' = K s`` leaves
    ``Q Kᵀ`` unchanged. transformers' llama / qwen2 / qwen3 / mistral apply RoPE
    with ``rotate_half`` (``q * cos + rotate_half(q) * sin``, channels ``d`` and
    ``d + D/2`` rotate together; transformers
    ``src/transformers/models/llama/modeling_llama.py`` ``apply_rotary_pos_emb``),
    so ``s`` is shared by each such pair and commutes with RoPE; it is also shared
    by all query heads of a KV group. Folded into ``q_proj`` / ``k_proj`` rows (and
    biases) — or, for models with a per-head ``q_norm`` / ``k_norm`` (Qwen3, applied
    after the projection), into those norms' weights, which are shared by every
    head, so ``s`` is then one ``[D/2]`` vector per layer. ``s = (q / k) ** β`` with
    ``q`` / ``k`` the largest pair norm ``sqrt(x_d² + x_{d+D/2}²)`` (invariant under
    RoPE) over the calibration tokens; ``β`` is searched per layer in
    :data:`SMOOTHING_EXPONENTS` (``0`` = no smoothing, ``0.5`` = balanced) by the
    total-variation error of the causal attention probabilities of a kept
    calibration sample with Q and K fake-quantized per head.

Layer-local: every decision of a layer depends on that layer's own Q / K
statistics in the original float model (one statistics forward over the first
:data:`STATS_SAMPLES` calibration samples, before anything is folded) and on
``(seed, layer index, KV head)``; a calibration that runs one
decoder layer at a time on the float hidden states reaches the same weights bit
for bit. The transforms run before the linears are quantized and before the FA
scales are observed, so both see the folded weights.

MLA (DeepSeek-V3): ``qk-smoothing`` is the latent smoothing of :mod:`.latent`
(``kv_a_layernorm`` weight times ``s``, ``kv_b_proj`` columns divided by ``s``);
``v-rotation`` has no MLA form (V is the latent cache itself) and is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.families import norm_offset
from ascend_fa.hf_compat import rotary_dim
from ascend_fa.linear.typed_inputs import layer_kwargs

from .common import causal_probs, fake_quant_absmax, first_row_sample
from .hadamard import random_hadamard
from .latent import LatentStats, fold_latent_smoothing, latent_smoothing_factors

__all__ = [
    "ATTENTION_TRANSFORMS",
    "SMOOTHING_EXPONENTS",
    "STATS_SAMPLES",
    "LayerTransform",
    "LayerwiseTransforms",
    "TransformResult",
    "apply_attention_transforms",
    "fold_qk_smoothing",
    "fold_v_rotation",
    "parse_transforms",
    "smoothing_factors",
    "v_rotation_matrix",
]

#: Transform names ``calibrate --transforms`` accepts, in the order they are folded.
ATTENTION_TRANSFORMS = ("v-rotation", "qk-smoothing")
#: Exponents ``β`` of ``s = (q / k) ** β`` tried per layer (0 keeps the layer as is).
SMOOTHING_EXPONENTS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625)
#: Calibration samples the Q / K statistics forward reads (the first ones): outlier
#: channels are a property of the weights, a few samples find them, and the extra
#: forward stays a fraction of the calibration.
STATS_SAMPLES = 8


def parse_transforms(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"v-rotation,qk-smoothing"`` (or a sequence, or None / ``"none"``) -> the
    transform names in folding order; an unknown name raises ``InputError``."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = {str(v).strip().lower() for v in items if str(v).strip()}
    if names <= {"none"}:
        return ()
    names.discard("none")
    unknown = sorted(names - set(ATTENTION_TRANSFORMS))
    if unknown:
        raise InputError(
            f"--transforms: unknown transform {unknown[0]!r}; choose from "
            f"{', '.join(ATTENTION_TRANSFORMS)} (comma separated) or none"
        )
    return tuple(t for t in ATTENTION_TRANSFORMS if t in names)


@dataclass
class LayerTransform:
    """What was folded into one attention module."""

    name: str
    index: int
    v_rotation_seeds: list[int] | None = None
    #: chosen exponent β (None: smoothing not applied)
    qk_exponent: float | None = None
    #: β -> attention-probability error of the kept sample
    qk_errors: dict[float, float] = field(default_factory=dict)
    #: ``s`` ``[G, D/2]`` (G = KV heads, or 1 when folded into q_norm / k_norm);
    #: ``[R]`` for MLA (latent channels)
    qk_factors: torch.Tensor | None = None

    def to_report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "index": self.index}
        if self.v_rotation_seeds is not None:
            out["v_rotation_seeds"] = self.v_rotation_seeds
        if self.qk_exponent is not None:
            out["qk_smoothing_exponent"] = self.qk_exponent
            out["qk_smoothing_errors"] = {
                f"{b:g}": round(e, 6) for b, e in self.qk_errors.items()
            }
            if self.qk_factors is not None:
                f = self.qk_factors
                out["qk_smoothing_factor_range"] = [
                    float(f.min()),
                    float(f.max()),
                ]
        return out


@dataclass
class TransformResult:
    """The transforms folded into a model, per attention module, and the time."""

    transforms: tuple[str, ...]
    seed: int
    layers: list[LayerTransform]
    seconds: float = 0.0
    #: MLA model: ``qk-smoothing`` is the latent smoothing
    mla: bool = False

    def to_report(self) -> dict[str, Any]:
        return {
            "folded": list(self.transforms),
            "seed": self.seed,
            "seconds": round(self.seconds, 3),
            "layers": [layer.to_report() for layer in self.layers],
        }

    def description_metadata(self) -> dict[str, Any]:
        """The description's ``metadata`` entry: what was folded where."""
        where = {
            "v-rotation": "v_proj weight/bias rows and o_proj columns (per KV head "
            "randomised-sign Hadamard)",
            "qk-smoothing": "q_proj/k_proj rows and biases, or q_norm/k_norm weights "
            "(per RoPE pair factor, shared by a KV group)",
        }
        if self.mla:
            where["qk-smoothing"] = (
                "kv_a_layernorm weight times s and kv_b_proj columns divided by s "
                "(per latent channel factor: q_abs / s, latent * s)"
            )
        return {
            "ascend_fa_transforms": {t: where[t] for t in self.transforms},
            "ascend_fa_transforms_seed": self.seed,
        }


def _geometry(module: nn.Module) -> tuple[int, int, int]:
    cfg = module.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    return heads, kv_heads, int(module.head_dim)


def _linear(module: nn.Module, name: str) -> nn.Linear:
    lin = getattr(module, name, None)
    if type(lin) is not nn.Linear:
        raise UnsupportedError(
            f"{name} is {type(lin).__name__}, not a float nn.Linear: attention "
            "transforms are folded before the linears are quantized"
        )
    return lin


def _layer_seed(seed: int, index: int, head: int) -> int:
    # A pure function of (seed, layer, head): a layer-at-a-time calibration builds
    # the same matrices.
    return (seed * 1_000_003 + index * 4_099 + head) % (1 << 62)


def v_rotation_matrix(seed: int, index: int, head: int, dim: int) -> torch.Tensor:
    """``R`` ``[D, D]`` float64 of KV head ``head`` of attention module ``index``."""
    return random_hadamard(dim, _layer_seed(seed, index, head), torch.float64)


@torch.no_grad()
def fold_v_rotation(module: nn.Module, index: int, seed: int) -> list[int]:
    """Rotate every KV head's V of a GQA attention ``module`` (see the module doc);
    returns the per-head seeds. Computed in float64, stored in the weights' dtype."""
    heads, kv_heads, dim = _geometry(module)
    v, o = _linear(module, "v_proj"), _linear(module, "o_proj")
    seeds = [_layer_seed(seed, index, h) for h in range(kv_heads)]
    r = torch.stack([v_rotation_matrix(seed, index, h, dim) for h in range(kv_heads)])
    # [Hkv, D, in]: v_proj rows of head h become R_hᵀ W_h.
    wv = r.transpose(1, 2) @ v.weight.double().reshape(kv_heads, dim, -1)
    # [out, H, D]: o_proj columns of query head i become W_i R_{i // group}.
    rq = r.repeat_interleave(heads // kv_heads, dim=0)
    wo = o.weight.double().reshape(o.weight.shape[0], heads, dim)
    wo = torch.einsum("ohd,hde->ohe", wo, rq)
    v.weight.copy_(wv.reshape(v.weight.shape).to(v.weight.dtype))
    o.weight.copy_(wo.reshape(o.weight.shape).to(o.weight.dtype))
    if v.bias is not None:
        bv = torch.einsum("hde,hd->he", r, v.bias.double().reshape(kv_heads, dim))
        v.bias.copy_(bv.reshape(-1).to(v.bias.dtype))
    return seeds


def _per_channel(factors: torch.Tensor, heads: int) -> torch.Tensor:
    """``[G, D/2]`` pair factors -> ``[heads, D]`` channel factors (each group's
    rows repeated over its ``heads // G`` heads, each pair over ``d, d + D/2``)."""
    full = torch.cat([factors, factors], dim=-1)
    return full.repeat_interleave(heads // factors.shape[0], dim=0)


def _qk_norms(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    qn, kn = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if qn is None and kn is None:
        return None
    if getattr(qn, "weight", None) is None or getattr(kn, "weight", None) is None:
        raise UnsupportedError(
            "qk-smoothing: q_norm / k_norm without a weight cannot carry the factor"
        )
    return qn, kn


@torch.no_grad()
def fold_qk_smoothing(module: nn.Module, factors: torch.Tensor) -> None:
    """Fold ``s`` (``[Hkv, D/2]``, or ``[1, D/2]`` for a module with ``q_norm`` /
    ``k_norm``) as ``Q / s`` and ``K s`` into ``module``'s weights (float64, stored
    in the weights' dtype)."""
    heads, kv_heads, dim = _geometry(module)
    f = factors.double()
    norms = _qk_norms(module)
    if norms is not None:
        qn, kn = norms
        ch = torch.cat([f[0], f[0]])
        # Gemma's norms scale by (1 + w): the factor folds as (1 + w) * c - 1.
        off = norm_offset(getattr(getattr(module, "config", None), "model_type", None))
        qw, kw = qn.weight.double(), kn.weight.double()
        q_new = (qw + off) / ch - off if off else qw / ch
        k_new = (kw + off) * ch - off if off else kw * ch
        qn.weight.copy_(q_new.to(qn.weight.dtype))
        kn.weight.copy_(k_new.to(kn.weight.dtype))
        return
    q, k = _linear(module, "q_proj"), _linear(module, "k_proj")
    for lin, rows in (
        (q, 1.0 / _per_channel(f, heads)),
        (k, _per_channel(f, kv_heads)),
    ):
        r = rows.reshape(-1)
        lin.weight.copy_((lin.weight.double() * r[:, None]).to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_((lin.bias.double() * r).to(lin.bias.dtype))


def _pair_norm(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D/2]``: ``sqrt(x_d² + x_{d+D/2}²)`` (RoPE invariant)."""
    half = x.shape[-1] // 2
    xf = x.float()
    return torch.sqrt(xf[..., :half] ** 2 + xf[..., half:] ** 2)


class _QKStats(nn.Module):
    """An FA point that returns its input and keeps, per head, the largest pair
    norm over real tokens and the first :data:`~.common.SEARCH_TOKENS` real tokens
    of the first row it sees (``[H, n, D]`` float32)."""

    def __init__(self, num_heads: int, head_dim: int | None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.pair_max: torch.Tensor | None = None
        self.sample: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        norms = _pair_norm(x)  # [B, H, S, D/2]
        if token_mask is not None:
            norms = norms * token_mask[:, None, :, None].to(norms.dtype)
        m = norms.amax(dim=(0, 2)).cpu()
        self.pair_max = m if self.pair_max is None else torch.maximum(self.pair_max, m)
        if self.sample is None:
            self.sample = first_row_sample(x, token_mask)
        return x


def _attention_probs(q: torch.Tensor, k: torch.Tensor, group: int) -> torch.Tensor:
    """Causal softmax probabilities ``[..., H, n, n]`` of ``q`` ``[..., H, n, D]``
    against ``k`` ``[..., Hkv, n, D]``."""
    kk = k.repeat_interleave(group, dim=-3)
    return causal_probs(q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]))


def smoothing_factors(
    q_max: torch.Tensor,
    k_max: torch.Tensor,
    q_sample: torch.Tensor,
    k_sample: torch.Tensor,
    *,
    shared: bool,
    exponents: Sequence[float] = SMOOTHING_EXPONENTS,
) -> tuple[float, torch.Tensor, dict[float, float]]:
    """Search ``β`` for one layer: ``(β, s [G, D/2], {β: error})``.

    ``q_max`` ``[H, D/2]`` / ``k_max`` ``[Hkv, D/2]``: largest pair norms over the
    calibration tokens; ``q_sample`` ``[H, n, D]`` / ``k_sample`` ``[Hkv, n, D]``:
    kept tokens (after RoPE; ``s`` commutes with it). ``shared``: one ``s`` for
    all heads (``G = 1``, folded into q_norm / k_norm), else one per KV group.
    The error of a ``β`` is the mean total variation ``½ Σ|P' - P|`` of the causal
    attention rows of the sample, Q and K fake-quantized per head with the static
    scale ``max_pair / 127`` the smoothed statistics give; ties keep the smaller
    ``β``.
    """
    heads, kv_heads = q_max.shape[0], k_max.shape[0]
    group = heads // kv_heads
    q_max, k_max = q_max.float(), k_max.float()
    q_sample, k_sample = q_sample.float(), k_sample.float()
    qg = q_max.reshape(kv_heads, group, -1).amax(dim=1)  # [Hkv, D/2]
    kg = k_max
    if shared:
        qg, kg = qg.amax(dim=0, keepdim=True), kg.amax(dim=0, keepdim=True)
    tiny = torch.finfo(torch.float32).tiny
    ratio = torch.where(
        (qg > tiny) & (kg > tiny), qg / kg.clamp(min=tiny), torch.ones_like(qg)
    )
    ref = _attention_probs(q_sample, k_sample, group)
    # Every exponent at once ([E, ...] batches): few large ops instead of many
    # small ones.
    betas = torch.tensor([float(b) for b in exponents], dtype=torch.float32)
    s_all = ratio[None] ** betas[:, None, None]  # [E, G, D/2]
    rep_q, rep_k = heads // s_all.shape[1], kv_heads // s_all.shape[1]
    sq = torch.cat([s_all, s_all], -1).repeat_interleave(rep_q, 1)  # [E, H, D]
    sk = torch.cat([s_all, s_all], -1).repeat_interleave(rep_k, 1)  # [E, Hkv, D]
    q_abs = (q_max[None] / s_all.repeat_interleave(rep_q, 1)).amax(-1)  # [E, H]
    k_abs = (k_max[None] * s_all.repeat_interleave(rep_k, 1)).amax(-1)
    qq = fake_quant_absmax(q_sample[None] / sq[:, :, None, :], q_abs)
    kq = fake_quant_absmax(k_sample[None] * sk[:, :, None, :], k_abs)
    p = _attention_probs(qq, kq, group)  # [E, H, n, n]
    err = (0.5 * (p - ref[None]).abs().sum(-1)).mean(dim=(1, 2))  # [E]
    errors = {float(b): float(e) for b, e in zip(betas, err, strict=True)}
    # The smallest error; ties keep the smaller exponent (first in order).
    best = int(torch.argmin(err))
    return float(betas[best]), s_all[best], errors


def _is_mla(model: nn.Module) -> bool:
    from ascend_fa.families import is_mla

    return is_mla(getattr(model.config, "model_type", None))


def _check_supported(
    model: nn.Module, modules: list[tuple[str, nn.Module]], names: Sequence[str]
) -> None:
    cfg = model.config
    if not modules:
        raise UnsupportedError(
            f"attention transforms are built for GQA/MHA decoders (llama, qwen2, "
            f"qwen3, mistral) and DeepSeek-V3 MLA, not "
            f"{getattr(cfg, 'model_type', '?')!r}"
        )
    if _is_mla(model):
        if "v-rotation" in names:
            raise UnsupportedError(
                "v-rotation has no MLA form: V is the latent cache itself, shared "
                "by every head and by K (deepseek_v3 takes --transforms "
                "qk-smoothing, the latent smoothing)"
            )
        for _, module in modules:
            _linear(module, "kv_b_proj")
        return
    rotated = rotary_dim(cfg)
    for name, module in modules:
        heads, _, dim = _geometry(module)
        if _linear(module, "q_proj").out_features == 2 * heads * dim:
            # Qwen3-Next: o_proj reads attn_output * sigmoid(gate); a rotation of
            # V mixes the channels the gate scales one by one, and Q's factor
            # would land on q_norm's zero-centred (1 + w) weight.
            raise UnsupportedError(
                f"{name}: gated attention (q_proj gives query and output gate); "
                "attention transforms are not folded into it, run without "
                "--transforms"
            )
    if rotated is not None:
        raise UnsupportedError(
            f"qk-smoothing needs RoPE over the whole head; it rotates the first "
            f"{rotated} channels (partial RoPE)"
        )
    for name, module in modules:
        heads, kv_heads, dim = _geometry(module)
        if heads % kv_heads or dim % 2:
            raise UnsupportedError(
                f"{name}: {heads} query heads over {kv_heads} KV heads, head_dim "
                f"{dim}: attention transforms need whole KV groups and an even D"
            )


@torch.no_grad()
def _qk_statistics(
    model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], mla: bool = False
) -> dict[str, dict[str, Any]]:
    from ascend_fa.adapters import injected_points
    from ascend_fa.adapters.hf import run_forwards, swapped_points

    with injected_points(model) as (_adapter, mods):

        def make(_attn: str, branch: str, point: nn.Module) -> nn.Module | None:
            if branch == "fa_v":
                return None
            if mla:
                return LatentStats(int(point.num_heads))
            return _QKStats(int(point.num_heads), getattr(point, "head_dim", None))

        with swapped_points(mods, make) as placed:
            run_forwards(model, batches)
    out: dict[str, dict[str, _QKStats]] = {}
    for (attn, branch), point in placed.items():
        out.setdefault(attn, {})[branch] = point
    return out


def _observed(stats: dict[str, dict[str, Any]], name: str) -> tuple[Any, Any]:
    """The ``fa_q`` / ``fa_k`` statistics points of attention ``name``; an
    ``InputError`` when no calibration token reached it."""
    st = stats.get(name)
    if st is None or st["fa_q"].sample is None or st["fa_k"].sample is None:
        raise InputError(
            f"qk-smoothing: no calibration token reached {name} (empty "
            "calibration batches?)"
        )
    return st["fa_q"], st["fa_k"]


def _decide(
    layer: LayerTransform, module: nn.Module, q: Any, k: Any, mla: bool
) -> None:
    """Search ``qk-smoothing``'s exponent of one attention module from its Q / K
    (MLA: absorbed query / latent) statistics points ``q`` / ``k``."""
    if mla:
        beta, s, errors = latent_smoothing_factors(
            q.abs_max, k.abs_max, q.sample, k.sample, scaling=float(module.scaling)
        )
    else:
        beta, s, errors = smoothing_factors(
            q.pair_max,
            k.pair_max,
            q.sample,
            k.sample,
            shared=_qk_norms(module) is not None,
        )
    layer.qk_exponent, layer.qk_errors = beta, errors
    layer.qk_factors = s if beta != 0.0 else None


def _fold_smoothing(layer: LayerTransform, module: nn.Module, mla: bool) -> None:
    if layer.qk_factors is None:
        return
    if mla:
        fold_latent_smoothing(module, layer.qk_factors)
    else:
        fold_qk_smoothing(module, layer.qk_factors)


def _prepare(
    model: nn.Module, transforms: Sequence[str]
) -> tuple[tuple[str, ...], list[tuple[str, nn.Module]], bool]:
    """Parse and check ``transforms`` for ``model``: ``(names, attention modules,
    mla)``; a refusal raises before anything is changed."""
    from ascend_fa.adapters import get_adapter

    names = parse_transforms(list(transforms))
    modules = get_adapter(model).attention_modules(model)
    _check_supported(model, modules, names)
    mla = _is_mla(model)
    if not mla:
        for _, module in modules:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                _linear(module, proj)
    return names, modules, mla


def apply_attention_transforms(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    transforms: Sequence[str],
    *,
    seed: int = 0,
) -> TransformResult:
    """Fold ``transforms`` (names from :func:`parse_transforms`) into every
    attention module of ``model`` in place; ``batches`` (tokenized calibration
    batches) feed the Q / K statistics of ``qk-smoothing`` (one float forward
    before anything is folded). Raises ``UnsupportedError`` for what the
    transforms cannot fold (see :func:`_check_supported`).
    :class:`LayerwiseTransforms` reaches the same decisions inside a layer-major
    calibration pass, without this extra forward."""
    t0 = time.perf_counter()
    names, modules, mla = _prepare(model, transforms)
    layers = [LayerTransform(name, i) for i, (name, _) in enumerate(modules)]
    if "qk-smoothing" in names:
        stats = _qk_statistics(model, batches, mla=mla)
        # Every decision first, then every fold: a refusal leaves the model as is.
        for layer, (name, module) in zip(layers, modules, strict=True):
            q, k = _observed(stats, name)
            _decide(layer, module, q, k, mla)
    for layer, (_name, module) in zip(layers, modules, strict=True):
        if "v-rotation" in names:
            layer.v_rotation_seeds = fold_v_rotation(module, layer.index, seed)
        _fold_smoothing(layer, module, mla)
    return TransformResult(names, seed, layers, time.perf_counter() - t0, mla=mla)


class _StopLayer(Exception):
    """Raised by a forward hook to end a decoder layer's call after its attention
    (the statistics need nothing further)."""


def _raise_stop(*_args: Any) -> None:
    raise _StopLayer


class _PassThrough(nn.Module):
    """An FA point that returns its input and observes nothing."""

    def forward(self, x: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        return x


class LayerwiseTransforms:
    """The transforms folded inside a layer-major calibration pass
    (:func:`~ascend_fa.calibration.layerwise.run_layerwise`'s ``before_layer``).

    :func:`apply_attention_transforms` runs one extra float forward over the first
    :data:`STATS_SAMPLES` samples for ``qk-smoothing``'s statistics, about a
    quarter of a 32-sample calibration. Here, before decoder layer ``i`` is
    observed, the same statistics come from layer ``i``'s own inputs (the first
    batches holding at least ``stats_rows`` rows), running the layer only up to
    the end of its attention; the factors are then searched and folded into that
    layer, so its FA points observe the folded Q / K. The inputs of layer ``i``
    are the float model's (the earlier folds are exact and the FA points pass
    their input through while observing), so the decisions are those of the
    extra forward up to float rounding. ``v-rotation`` needs no statistics and
    is folded into every module at construction.

    Only attention modules that carry FA points during the pass are smoothed: a
    module the recipe leaves out stays float on the device and gains nothing from
    ``qk-smoothing`` (its record keeps no exponent).
    """

    def __init__(
        self,
        model: nn.Module,
        transforms: Sequence[str],
        *,
        seed: int = 0,
        stats_rows: int = STATS_SAMPLES,
    ) -> None:
        t0 = time.perf_counter()
        self.model = model
        self.seed = seed
        self.stats_rows = stats_rows
        self.names, modules, self.mla = _prepare(model, transforms)
        self.modules = modules
        self.layers = [LayerTransform(name, i) for i, (name, _) in enumerate(modules)]
        if "v-rotation" in self.names:
            for layer, (_name, module) in zip(self.layers, modules, strict=True):
                layer.v_rotation_seeds = fold_v_rotation(module, layer.index, seed)
        self.seconds = time.perf_counter() - t0

    @torch.no_grad()
    def __call__(
        self,
        index: int,
        layer: nn.Module,
        inputs: Sequence[Any],
        masks: Sequence[torch.Tensor | None],
    ) -> None:
        """Before decoder ``layer`` (number ``index``) runs over ``inputs``
        (``(hidden, kwargs, keep)`` per batch, with padding ``masks``): gather the
        statistics of its attention modules, decide and fold."""
        if "qk-smoothing" not in self.names:
            return
        from ascend_fa.adapters.base import token_mask_scope
        from ascend_fa.adapters.hf import fa_points, swapped_points

        t0 = time.perf_counter()
        inside = {id(m) for m in layer.modules()}
        mine = [
            (rec, name, module)
            for rec, (name, module) in zip(self.layers, self.modules, strict=True)
            if id(module) in inside
            and {b for b, _ in fa_points(module)} >= {"fa_q", "fa_k"}
        ]
        if not mine:
            return

        def make(_attn: str, branch: str, point: nn.Module) -> nn.Module | None:
            if branch not in ("fa_q", "fa_k"):
                # The pass's own observers must not see the statistics run.
                return _PassThrough()
            if self.mla:
                return LatentStats(int(point.num_heads))
            return _QKStats(int(point.num_heads), getattr(point, "head_dim", None))

        stop = mine[-1][2].register_forward_hook(_raise_stop)
        rows = 0
        try:
            with swapped_points({n: m for _, n, m in mine}, make) as placed:
                for j, (hidden, kwargs, _keep) in enumerate(inputs):
                    if rows >= self.stats_rows:
                        break
                    with token_mask_scope(self.model, masks[j]):
                        try:
                            layer(hidden, **layer_kwargs(layer, kwargs))
                        except _StopLayer:
                            pass
                    rows += int(hidden.shape[0])
        finally:
            stop.remove()
        stats: dict[str, dict[str, Any]] = {}
        for (attn, branch), point in placed.items():
            stats.setdefault(attn, {})[branch] = point
        for rec, name, module in mine:
            q, k = _observed(stats, name)
            _decide(rec, module, q, k, self.mla)
            _fold_smoothing(rec, module, self.mla)
        self.seconds += time.perf_counter() - t0

    def result(self) -> TransformResult:
        """What was folded (call after the pass)."""
        return TransformResult(
            self.names, self.seed, self.layers, self.seconds, mla=self.mla
        )
