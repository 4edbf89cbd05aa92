"""MLA attention of the vLLM plugin: FAKQuant (DeepSeek-V3 / R1) on an int8
latent cache, written by :func:`ascend_fa.attention.reshape_and_cache_mla`
(quantize on write) and read by :func:`~ascend_fa.attention.mla_paged_attention`
/ :func:`~ascend_fa.attention.mla_prefill_attention` -- the ops ``ascend-fa``'s
MLA emulation runs, not a copy.

=================  ==========================================================
tensor             use
=================  ==========================================================
``fa_q.scale``     ``[H]``: the absorbed query ``q_nope @ W_UK`` ``[T, H, R]``
                   quantized statically per head (MindIE's FAKQuant, and
                   ``ascend-fa eval``'s fake-quant of the artifact); for an
                   artifact written for vllm-ascend (its description's
                   ``metadata.ascend_fa_target``) the query is quantized per
                   token and head dynamically instead, ``rowmax|q| / 127``, as
                   vllm-ascend's MLA does (``fa_q`` loaded, not used)
``fa_k.scale``     ``[1]``: the latent ``c_kv`` after ``kv_a_layernorm``
                   ``[T, R]``, int8 in the cache; K and V of absorbed MLA
``fa_v.scale``     ``[1]``: loaded and checked, not used (the device
                   dequantizes V, the same latent, with ``fa_k.scale``)
=================  ==========================================================

The RoPE part ``k_pe`` ``[T, Dr]`` stays in the model dtype, as on the device.

vLLM's ``MLAAttention`` (``vllm/model_executor/layers/attention/
mla_attention.py``) asks the quantization config for its method while it is
built, *before* it builds its impl; :meth:`AscendMLAMethod.create_weights` sets
the layer's backend to :class:`AscendMLABackend`, so the impl vLLM builds is
:class:`AscendMLAImpl`. ``MLAAttention.forward_impl`` then calls the impl's
three hooks: ``do_kv_cache_update`` (the write), ``forward_mqa`` (decode: vLLM
has absorbed the query with ``W_UK``; the impl returns the latent output and
vLLM applies ``W_UV``) and ``forward_mha`` (prefill: the impl absorbs the query
itself, attends over the int8 cache and applies ``W_UV``: the same absorbed
computation as decode, where vLLM's own prefill attends the float
``kv_b_proj`` expansion of the step's latent).

Cache memory. vLLM allocates the layer's cache as ``[NB, BS, R + Dr]`` in the
model dtype (the spec stays vLLM's: no memory is saved). The plugin reads that
memory as two contiguous caches: int8 latent ``[NB, BS, 1, R]`` in its first
``NB*BS*R`` bytes, then the RoPE cache ``[NB, BS, 1, Dr]`` in the model dtype
(NZ with ``ASCEND_FA_VLLM_KV_LAYOUT=nz``: ``[NB, R // 32, BS, 32]`` and
``[NB, Dr // C0, BS, C0]``). Block ``b`` of vLLM's block table is block ``b`` of
both. The int8 fractal needs ``BS`` a multiple of 32: vLLM's CPU platform
forces ``BS`` 16 for its reference ``CPU_MLA`` backend (CPUs without AMX,
``vllm/platforms/cpu.py`` ``check_and_update_config``), and the plugin refuses
that at start-up; with AMX vLLM keeps 128.
"""

from __future__ import annotations

import re
import weakref

import torch
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from ascend_fa import settings
from ascend_fa.atb_ops import c0
from ascend_fa.attention import (
    mla_paged_attention,
    mla_prefill_attention,
    reshape_and_cache_mla,
)
from ascend_fa.emulation.scales import load_scales

__all__ = [
    "MLA_SCALE_MAPPER_REGEX",
    "AscendMLABackend",
    "AscendMLAImpl",
    "AscendMLAMethod",
    "latent_cache_views",
]

#: Checkpoint name -> vLLM ``MLAAttention`` parameter name: DeepSeek's
#: ``<attn>.fa_q.scale`` -> ``<attn>.mla_attn.mla_attn.fa_q_scale``
#: (``DeepseekV2MLAAttention.mla_attn`` is the wrapper, its ``mla_attn`` the
#: layer: ``vllm/model_executor/layers/mla.py``).
MLA_SCALE_MAPPER_REGEX = {
    re.compile(r"\.(fa_[qkv])\.(scale|offset)$"): r".mla_attn.mla_attn.\1_\2",
}
_BRANCHES = ("fa_q", "fa_k", "fa_v")
LAYOUT_ENV = "ASCEND_FA_VLLM_KV_LAYOUT"
#: int8 caches keep 32-row blocks (one 32x32-byte fractal, ``atb_ops.cache``).
BLOCK_MULTIPLE = 32


def latent_cache_views(
    kv_cache: torch.Tensor, rank: int, rope_dim: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 latent cache and the RoPE cache (module doc) in vLLM's cache of
    an MLA layer, ``kv_cache`` ``[NB, BS, R + Dr]`` (model dtype, contiguous)."""
    if not kv_cache.is_contiguous():
        raise ValueError("ascend-fa: vLLM's MLA cache of a layer is not contiguous")
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    raw = kv_cache.view(-1).view(torch.int8)
    n_lat = nb * bs * rank
    rope = raw[n_lat : n_lat + nb * bs * rope_dim * kv_cache.element_size()]
    rope = rope.view(kv_cache.dtype)
    if layout == "nz":
        cr = c0(kv_cache.dtype)
        return (raw[:n_lat].view(nb, rank // 32, bs, 32),
                rope.view(nb, rope_dim // cr, bs, cr))  # fmt: skip
    return raw[:n_lat].view(nb, bs, 1, rank), rope.view(nb, bs, 1, rope_dim)


class AscendMLAImpl(CPUMLAImpl):
    """vLLM's CPU MLA impl (its constructor's checks and attributes) with the
    cache write, the decode and the prefill replaced by ascend-fa's ops. The
    quant method sets ``ascend_scales`` (``{"q", "k", "v"}`` fp32; ``q`` None
    for a dynamic query),
    ``ascend_layout`` and ``ascend_layer`` (the layer, for ``W_UK_T`` / ``W_UV``)
    after loading."""

    ascend_layout: str = "nd"
    ascend_scales: dict[str, torch.Tensor] | None = None
    ascend_layer = None

    def _views(self, kv_cache: torch.Tensor):
        return latent_cache_views(kv_cache, self.kv_lora_rank, self.qk_rope_head_dim,
                                  self.ascend_layout)  # fmt: skip

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping,
                           kv_cache_dtype, k_scale) -> None:  # fmt: skip
        if kv_cache.numel() == 0:
            return
        lat, rope = self._views(kv_cache)
        n = slot_mapping.shape[0]
        reshape_and_cache_mla(
            kv_c_normed[:n].contiguous(),
            k_pe[:n].reshape(n, -1).contiguous(),
            lat, rope, slot_mapping.flatten().to(torch.int64),
            k_scale=self.ascend_scales["k"], layout=self.ascend_layout,
        )  # fmt: skip

    def _attend(self, q_nope, q_pe, kv_cache, table, seq_lens, query_lens=None):
        lat, rope = self._views(kv_cache)
        sc = self.ascend_scales
        common = dict(scale=self.scale, k_scale=sc["k"], q_scale=sc["q"],
                      layout=self.ascend_layout)  # fmt: skip
        table = table.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        if query_lens is None:
            return mla_paged_attention(q_nope.contiguous(), q_pe.contiguous(), lat,
                                       rope, table, seq_lens, **common)  # fmt: skip
        return mla_prefill_attention(q_nope, q_pe, lat, rope, table, seq_lens,
                                     query_lens=query_lens, **common)  # fmt: skip

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """Decode: ``q`` is ``(q_nope @ W_UK [B, H, R], q_pe [B, H, Dr])``;
        returns the latent output ``[B, H, R]`` (vLLM applies ``W_UV``)."""
        if not isinstance(q, tuple):
            q = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        dec = attn_metadata.decode
        out = self._attend(q[0], q[1], kv_c_and_k_pe_cache, dec.block_table,
                           dec.seq_lens)  # fmt: skip
        return out, None

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata,
                    k_scale, output, output_scale=None) -> None:  # fmt: skip
        """Prefill, absorbed as decode: ``q`` ``[T, H, nope + Dr]`` -> ``output``
        ``[T, H * v]``, over the int8 cache (the step's latent is in it)."""
        if output_scale is not None:
            raise NotImplementedError("ascend-fa: fused output quantization")
        pre = attn_metadata.prefill
        layer = self.ascend_layer
        starts = pre.query_start_loc.tolist()
        qlens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        ctx = pre.chunked_context
        past = ctx.context_lens_list if ctx is not None else [0] * len(qlens)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # [H, T, nope] @ [H, nope, R] -> [T, H, R], in the model dtype (as decode)
        ql = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)
        b, s = len(qlens), max(qlens)
        qn = ql.new_zeros(b, s, self.num_heads, self.kv_lora_rank)
        qr = q_pe.new_zeros(b, s, self.num_heads, self.qk_rope_head_dim)
        for i, (a, n) in enumerate(zip(starts, qlens)):
            qn[i, :n] = ql[a : a + n]
            qr[i, :n] = q_pe[a : a + n]
        seq = torch.tensor([p + n for p, n in zip(past, qlens)], dtype=torch.int32)
        lat = self._attend(qn, qr, kv_c_and_k_pe_cache, pre.block_table, seq,
                           torch.tensor(qlens, dtype=torch.int32))  # fmt: skip
        out = output.view(-1, self.num_heads, self.v_head_dim)
        for i, (a, n) in enumerate(zip(starts, qlens)):
            # [H, n, R] @ [H, R, v] -> [n, H, v]
            out[a : a + n] = torch.bmm(lat[i, :n].transpose(0, 1),
                                       layer.W_UV).transpose(0, 1)  # fmt: skip


class AscendMLABackend(CPUMLABackend):
    """vLLM's CPU MLA backend (metadata builder, cache shape) with
    :class:`AscendMLAImpl` and the int8 cache's block sizes; given to the
    layers of a FAKQuant artifact, not registered globally."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % BLOCK_MULTIPLE == 0

    @staticmethod
    def get_impl_cls():
        return AscendMLAImpl


class AscendMLAMethod(BaseKVCacheMethod):
    """The quant method of an ``MLAAttention`` layer of a FAKQuant artifact:
    loads ``fa_{q,k,v}`` and switches the layer to :class:`AscendMLABackend`.
    ``dynamic_query``: quantize the query per token and head at run time
    (vllm-ascend) instead of with ``fa_q`` (MindIE)."""

    def __init__(self, quant_config, dynamic_query: bool = False):
        super().__init__(quant_config)
        self.dynamic_query = dynamic_query

    def create_weights(self, layer) -> None:
        from vllm.config import get_current_vllm_config

        super().create_weights(layer)
        bs = get_current_vllm_config().cache_config.block_size
        if bs is not None and bs % BLOCK_MULTIPLE:
            raise ValueError(
                f"{layer.layer_name}: FAKQuant's int8 latent cache needs a block "
                f"size that is a multiple of {BLOCK_MULTIPLE}, vLLM chose {bs} (its "
                "CPU platform forces 16 for the reference CPU_MLA backend on CPUs "
                "without AMX, vllm/platforms/cpu.py check_and_update_config)"
            )
        layout = settings.get(LAYOUT_ENV)
        layer.ascend_layout = layout
        layer.ascend_loaded = {}
        for base in _BRANCHES:
            for kind in ("scale", "offset"):
                p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
                p.weight_loader = _store(layer, f"{base}_{kind}")
                layer.register_parameter(f"{base}_{kind}", p)
        # MLAAttention builds its impl from this backend right after this call
        layer.attn_backend = AscendMLABackend

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        attn = layer.layer_name.removesuffix(".attn")
        got = layer.ascend_loaded
        for base in _BRANCHES:
            for kind in ("scale", "offset"):
                if f"{base}_{kind}" not in got:
                    raise ValueError(
                        f"{attn}.{base}.{kind}: missing from the checkpoint "
                        "(FAKQuant attention needs it)"
                    )
        entry = {b: (got[f"{b}_scale"], got[f"{b}_offset"]) for b in _BRANCHES}
        (scales,) = load_scales(
            {attn: entry}, mode="faquant", layer_names=[attn],
            num_heads=layer.num_heads, num_kv_heads=1, head_dim=layer.kv_lora_rank,
        )  # fmt: skip
        impl = layer.impl
        if not isinstance(impl, AscendMLAImpl):
            raise ValueError(f"{attn}: vLLM built {type(impl).__name__}, not the "
                             "plugin's MLA impl")  # fmt: skip
        if self.dynamic_query:
            scales["q"] = None
        impl.ascend_scales = scales
        impl.ascend_layout = layer.ascend_layout
        impl.ascend_layer = weakref.proxy(layer)
        for base in _BRANCHES:
            for kind in ("scale", "offset"):
                delattr(layer, f"{base}_{kind}")
        del layer.ascend_loaded


def _store(layer, name: str):
    def load(param, loaded, *args, **kwargs):
        layer.ascend_loaded[name] = loaded.detach().clone()

    return load
