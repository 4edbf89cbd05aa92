"""Attention of the vLLM plugin: the paged KV cache holds int8 codes, written by
:func:`ascend_fa.attention.reshape_and_cache` (quantize on write) and read by
:func:`~ascend_fa.attention.prefill_attention` / :func:`~ascend_fa.attention.
paged_attention` -- the functions ``ascend-fa emulate`` runs, not a copy.

==============  ================================  ===============================
description     scales (per attention layer)      emulate mode
==============  ================================  ===============================
``FAQuant``     ``fa_q`` ``[H]``, ``fa_k`` /      ``faquant``: Q, K, V int8 per
                ``fa_v`` ``[Hkv]``                head (MindIE's FA3)
``C8``          ``k`` / ``v`` ``[Hkv, D]``        ``c8``: K, V int8 per channel,
                                                  Q float (vllm-ascend)
==============  ================================  ===============================

The checkpoint's ``<attn>.fa_q.scale`` / ``<attn>.k_proj.kv_cache_scale`` load
into the vLLM ``Attention`` layer as ``fa_q_scale`` / ``k_cache_scale``
(:data:`SCALE_MAPPER`) and are checked there by the emulation's own
:func:`~ascend_fa.emulation.scales.load_scales` (one-line errors naming the
tensor).

Cache memory. vLLM allocates each layer's cache as its CPU backend lays it out,
``[NB, Hkv, BS, 2*D]`` in the spec's dtype; the layer's KV spec here says int8
(:attr:`AscendAttentionMethod.create_weights` sets ``kv_cache_torch_dtype``), so a
block takes half the bytes of bf16's and vLLM's block manager fits twice the
blocks. The plugin reads that memory as one contiguous cache of ``2*NB`` blocks in
ascend-fa's layout (``nd`` ``[2*NB, BS, Hkv, D]`` by default, ``nz``
``[2*NB, Hkv*D // 32, BS, 32]`` with ``ASCEND_FA_VLLM_KV_LAYOUT=nz``): vLLM
block ``b`` holds K in block ``2b`` and V in block ``2b + 1``. K is addressed
through the view from block 0, V through the view from block 1, both with the
block table ``2 * block_table``, so each is a contiguous paged cache of the ops.
"""

from __future__ import annotations

import re

import torch
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from ascend_fa import settings
from ascend_fa.attention import paged_attention, prefill_attention, reshape_and_cache
from ascend_fa.emulation.scales import load_scales

from .tensor_parallel import head_slice, tp_rank_size

__all__ = [
    "SCALE_MAPPER_REGEX",
    "AscendAttentionMethod",
    "AscendCPUAttentionBackend",
    "AscendCPUAttentionImpl",
    "cache_views",
    "doubled_slots",
    "rank_scales",
]

#: Checkpoint name -> vLLM Attention parameter name (regex, replacement).
SCALE_MAPPER_REGEX = {
    re.compile(r"\.(fa_[qkv])\.(scale|offset)$"): r".attn.\1_\2",
    re.compile(r"\.([kv])_proj\.kv_cache_(scale|offset)$"): r".attn.\1_cache_\2",
}
#: description scheme -> (emulate mode, parameter names loaded)
_MODES = {
    "FAQuant": ("faquant", ("fa_q", "fa_k", "fa_v")),
    "C8": ("c8", ("k_cache", "v_cache")),
}
LAYOUT_ENV = "ASCEND_FA_VLLM_KV_LAYOUT"


def cache_views(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V paged caches (module doc) in vLLM's per-layer cache
    ``kv_cache`` ``[NB, Hkv, BS, 2*D]`` int8: ``(whole[:-1], whole[1:])``, each
    ``2*NB - 1`` blocks (the same shape, as the ops want)."""
    if not kv_cache.is_contiguous():
        raise ValueError("ascend-fa: vLLM's KV cache of a layer is not contiguous")
    nb, _, bs, _ = kv_cache.shape
    if layout == "nz":
        width = num_kv_heads * head_size
        whole = kv_cache.view(2 * nb, width // 32, bs, 32)
    else:
        whole = kv_cache.view(2 * nb, bs, num_kv_heads, head_size)
    return whole[:-1], whole[1:]


def doubled_slots(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """vLLM slot ``s`` -> slot of the doubled cache (block ``2 * (s // BS)``);
    negative (padding) slots stay -1."""
    s = slot_mapping.to(torch.int64)
    out = (s // block_size) * (2 * block_size) + s % block_size
    return torch.where(s >= 0, out, torch.full_like(s, -1))


class _StepPlan:
    """What one engine step's attention metadata means to the ops, worked out by
    the step's first layer and reused by the others: vLLM builds one metadata
    object per step (the CPU backend's ``build``) and hands it to every layer.

    ``matches`` compares the object and the contents of its tensors with what the
    plan was made from, so a step whose metadata reuses an object or its buffers
    never runs on another step's plan. ``first_call`` tells whether a call of this
    kind (op, cache shape and dtype) already ran the ops' checks in this step; the
    other layers skip them (same block table, lengths, slots, shapes and dtypes;
    each layer's scales were checked when they loaded)."""

    def __init__(self, source, tensors: tuple[torch.Tensor, ...]):
        self.source = source
        self.copies = tuple(t.clone() for t in tensors)
        self.checked: set = set()

    def matches(self, source, tensors: tuple[torch.Tensor, ...]) -> bool:
        return source is self.source and all(
            a.shape == b.shape and torch.equal(a, b)
            for a, b in zip(tensors, self.copies)
        )

    def first_call(self, key) -> bool:
        if key in self.checked:
            return False
        self.checked.add(key)
        return True


class _AttentionPlan(_StepPlan):
    """The step's sequences split into decodes (one query token) and prefills,
    with the doubled block table and the lengths the ops take."""

    def __init__(self, meta):
        super().__init__(meta, _meta_tensors(meta))
        starts = meta.query_start_loc.tolist()
        lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        self.starts, self.lens = starts, lens
        seq_lens = meta.seq_lens[: len(lens)].to(torch.int32)
        table = (meta.block_table[: len(lens)] * 2).to(torch.int32)
        dec = [i for i, n in enumerate(lens) if n == 1]
        self.pre = [i for i, n in enumerate(lens) if n > 1]
        self.decode = None
        if dec == list(range(len(lens))):  # a decode batch: query rows 0 .. B-1
            self.decode = (slice(0, len(dec)), table, seq_lens)
        elif dec:
            rows = torch.tensor([starts[i] for i in dec])
            self.decode = (rows, table[dec].contiguous(), seq_lens[dec].contiguous())
        if self.pre:
            self.prefill = (table[self.pre].contiguous(),
                            seq_lens[self.pre].contiguous(),
                            torch.tensor([lens[i] for i in self.pre],
                                         dtype=torch.int32))  # fmt: skip


def _meta_tensors(meta) -> tuple[torch.Tensor, ...]:
    return (meta.query_start_loc, meta.seq_lens, meta.block_table)


#: The current step's plans (one engine runs its layers one after another).
_PLANS: dict[str, _StepPlan] = {}


def _attention_plan(meta) -> _AttentionPlan:
    plan = _PLANS.get("attention")
    if plan is None or not plan.matches(meta, _meta_tensors(meta)):
        plan = _PLANS["attention"] = _AttentionPlan(meta)
    return plan


class _SlotPlan(_StepPlan):
    """The step's slot mapping in the doubled cache (:func:`doubled_slots`)."""

    def __init__(self, slot_mapping: torch.Tensor, block_size: int):
        super().__init__(slot_mapping, (slot_mapping,))
        self.block_size = block_size
        self.slots = doubled_slots(slot_mapping, block_size)


def _slot_plan(slot_mapping: torch.Tensor, block_size: int) -> _SlotPlan:
    plan = _PLANS.get("slots")
    if (
        plan is None
        or plan.block_size != block_size
        or not plan.matches(slot_mapping, (slot_mapping,))
    ):
        plan = _PLANS["slots"] = _SlotPlan(slot_mapping, block_size)
    return plan


class AscendCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl with the cache write and the attention replaced
    by ascend-fa's ops (the metadata is the CPU backend's)."""

    ascend_mode: str = "faquant"
    ascend_layout: str = "nd"

    @classmethod
    def adopt(cls, impl: CPUAttentionBackendImpl, mode: str, layout: str):
        """Turn ``impl`` (built by vLLM's Attention) into this class in place."""
        if impl.sliding_window != -1 or impl.alibi_slopes is not None:
            raise ValueError(
                "ascend-fa: sliding-window and ALiBi attention are not emulated "
                "by the plugin's int8 cache"
            )
        impl.__class__ = cls
        impl.ascend_mode = mode
        impl.ascend_layout = layout
        impl.ascend_views = None
        return impl

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`cache_views` of the layer's cache, made once per cache tensor."""
        got = self.ascend_views
        if got is None or got[0] is not kv_cache:
            kc, vc = cache_views(kv_cache, self.num_kv_heads, self.head_size,
                                 self.ascend_layout)  # fmt: skip
            got = self.ascend_views = (kv_cache, kc, vc)
        return got[1], got[2]

    def _scales(self, layer) -> dict[str, torch.Tensor]:
        return layer.ascend_kv_scales

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        kc, vc = self._views(kv_cache)
        plan = _slot_plan(slot_mapping, kv_cache.shape[2])
        n = slot_mapping.shape[0]
        sc = self._scales(layer)
        check = plan.first_call(("write", kv_cache.shape, key.shape, key.dtype,
                                 self.ascend_mode))  # fmt: skip
        reshape_and_cache(
            key[:n], value[:n], kc, vc, plan.slots, k_scale=sc["k"], v_scale=sc["v"],
            layout=self.ascend_layout, check=check,
        )  # fmt: skip

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ascend-fa: fused output quantization")
        if attn_metadata is None:  # profiling run
            return output
        kc, vc = self._views(kv_cache)
        sc = self._scales(layer)
        common = dict(
            num_kv_heads=self.num_kv_heads, scale=self.scale, k_scale=sc["k"],
            v_scale=sc["v"], q_scale=sc.get("q"), layout=self.ascend_layout,
        )  # fmt: skip
        plan = _attention_plan(attn_metadata)
        if plan.decode is not None:
            rows, table, seq_lens = plan.decode
            check = plan.first_call(("decode", kv_cache.shape, query.shape,
                                     query.dtype, self.ascend_mode))  # fmt: skip
            out = paged_attention(query[rows].contiguous(), kc, vc, table, seq_lens,
                                  check=check, **common)  # fmt: skip
            output[rows] = out.to(output.dtype)
        if plan.pre:
            self._prefill(query, kc, vc, plan, output, common)
        return output

    def _prefill(self, query, kc, vc, plan: _AttentionPlan, output, common) -> None:
        starts, lens, pre = plan.starts, plan.lens, plan.pre
        table, seq_lens, qlens = plan.prefill
        s = max(lens[i] for i in pre)
        q = query.new_zeros(len(pre), s, self.num_heads, self.head_size)
        for j, i in enumerate(pre):
            q[j, : lens[i]] = query[starts[i] : starts[i + 1]]
        out = prefill_attention(q, kc, vc, table, seq_lens, query_lens=qlens,
                                **common)  # fmt: skip
        for j, i in enumerate(pre):
            output[starts[i] : starts[i + 1]] = out[j, : lens[i]].to(output.dtype)


class AscendCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend (its metadata builder) with :class:`AscendCPUAttention
    Impl`; given to the layers the plugin quantizes, not registered globally."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return AscendCPUAttentionImpl


class AscendAttentionMethod(BaseKVCacheMethod):
    """The quant method of an ``Attention`` layer of an FAQuant / C8 artifact:
    loads the scales, switches the layer to the int8 cache and ascend-fa's ops."""

    def __init__(self, quant_config, scheme: str):
        super().__init__(quant_config)
        self.mode, self.names = _MODES[scheme]
        self.scheme = scheme

    def create_weights(self, layer) -> None:
        from vllm.config import get_current_vllm_config

        super().create_weights(layer)
        layout = settings.get(LAYOUT_ENV)
        layer.ascend_loaded = {}
        # the file holds every head; this rank serves a slice (.tensor_parallel)
        rank, size = tp_rank_size()
        total_kv = get_current_vllm_config().model_config.get_total_num_kv_heads()
        layer.ascend_tp = (rank, size, layer.num_heads * size, total_kv)
        for base in self.names:
            for kind in ("scale", "offset"):
                p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
                p.weight_loader = _store(layer, f"{base}_{kind}")
                layer.register_parameter(f"{base}_{kind}", p)
        AscendCPUAttentionImpl.adopt(layer.impl, self.mode, layout)
        layer.attn_backend = AscendCPUAttentionBackend
        layer.kv_cache_torch_dtype = torch.int8

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        attn = layer.layer_name.removesuffix(".attn")
        got = layer.ascend_loaded
        missing = [f"{attn}.{n}" for n in _checkpoint_names(self.names) if
                   _param_name(n) not in got]  # fmt: skip
        if missing:
            raise ValueError(
                f"{missing[0]}: missing from the checkpoint ({self.scheme} "
                "attention needs it)"
            )
        if self.mode == "c8":
            entry = {s: got[f"{s}_cache_scale"] for s in ("k", "v")}
            for s in ("k", "v"):
                if bool(got[f"{s}_cache_offset"].float().any()):
                    raise ValueError(
                        f"{attn}.{s}_proj.kv_cache_offset: non-zero; the int8 cache "
                        "is symmetric (offset 0)"
                    )
        else:
            entry = {b: (got[f"{b}_scale"], got[f"{b}_offset"]) for b in self.names}
        rank, size, heads, kv_heads = layer.ascend_tp
        # checked against the whole model, as a single worker loads them, then
        # this rank's heads
        (scales,) = load_scales(
            {attn: entry}, mode=self.mode, layer_names=[attn],
            num_heads=heads, num_kv_heads=kv_heads, head_dim=layer.head_size,
        )  # fmt: skip
        layer.ascend_kv_scales = rank_scales(
            scales, attn, rank, size, layer.num_heads, layer.num_kv_heads
        )
        for base in self.names:
            for kind in ("scale", "offset"):
                delattr(layer, f"{base}_{kind}")
        del layer.ascend_loaded


def rank_scales(
    scales: dict[str, torch.Tensor],
    attn: str,
    rank: int,
    size: int,
    num_heads: int,
    num_kv_heads: int,
) -> dict[str, torch.Tensor]:
    """The whole layer's scales (``q`` ``[H]``, ``k`` / ``v`` ``[Hkv(, D)]``)
    cut to the heads rank ``rank`` of ``size`` serves (:func:`.tensor_parallel.
    head_slice`), checked against the layer's ``num_heads`` / ``num_kv_heads``."""
    if size == 1:
        return scales
    out = {}
    for key, t in scales.items():
        if t is None:
            out[key] = None
            continue
        want = num_heads if key == "q" else num_kv_heads
        branch = f"{attn}.{'fa_q' if key == 'q' else key} scale"
        part = t[head_slice(t.shape[0], rank, size, branch)].contiguous()
        if part.shape[0] != want:
            raise ValueError(
                f"{branch}: rank {rank} of {size} gets {part.shape[0]} heads, vLLM's "
                f"layer there has {want}"
            )
        out[key] = part
    return out


def _store(layer, name: str):
    def load(param, loaded, *args, **kwargs):
        layer.ascend_loaded[name] = loaded.detach().clone()

    return load


def _param_name(checkpoint: str) -> str:
    # "fa_q.scale" -> "fa_q_scale"; "k_proj.kv_cache_scale" -> "k_cache_scale"
    return checkpoint.replace("_proj.kv", "").replace(".", "_")


def _checkpoint_names(names: tuple[str, ...]) -> list[str]:
    out = []
    for base in names:
        for kind in ("scale", "offset"):
            if base.startswith("fa_"):
                out.append(f"{base}.{kind}")
            else:
                out.append(f"{base[0]}_proj.kv_cache_{kind}")
    return out
