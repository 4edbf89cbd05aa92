"""Whole-model emulation runtime: a LLaMA / Qwen / Mistral model on the paged int8
cache.

:func:`enable_paged_int8_attention` switches a transformers decoder's attention to
``"ascend_fa_paged"``, a function registered in transformers' ``AttentionInterface``
that replaces the model's K/V cache with a :class:`~ascend_fa.kvcache.PagedKVCache`
and runs every step through the runtime API, as an Ascend inference engine does:

* the step's new tokens (the last ``S`` of HF's ``key``/``value`` ``[B, Hkv, L, D]``,
  after RoPE, before ``repeat_kv``) are written with
  :func:`~ascend_fa.attention.reshape_and_cache` (quantized on write in the int8
  and FP8 modes);
* ``S > 1`` (prefill) attends with :func:`~ascend_fa.attention.prefill_attention`,
  ``S == 1`` (decode) with :func:`~ascend_fa.attention.paged_attention`, both over the
  paged cache only — HF's float K/V history is never read.

=============  =================  ==============================================
``mode``       cache              attention
=============  =================  ==============================================
``"float"``    model dtype        float (proves the plumbing: logits match the
                                  plain model)
``"int8_kv"``  int8, per KV head  float query, dequantized K/V ("antiquant")
``"faquant"``  int8, per KV head  query quantized per head with ``fa_q.scale``
``"c8"``       int8, per channel  float query; vllm-ascend's C8 cache (codes as
                                  its ``_quantize_kv_to_int8`` writes them)
``"fp8_kv"``   float8_e4m3fn,     float query; vLLM's FP8 cache
               per tensor / head
=============  =================  ==============================================

Scales (``scales=``, see :mod:`.scales`): an artifact directory (FA modes:
``<attn>.fa_{q,k,v}.scale``, ``[H, 1]`` or ``[H, D]``; ``c8``:
``<attn>.{k,v}_proj.kv_cache_scale`` ``[Hkv*D]``; ``fp8_kv``: ``<attn>.{k,v}_scale``
``[1]`` or ``[Hkv]``), or a map keyed by the attention modules' dotted names
(``model.layers.0.self_attn``): ``{attn: {"fa_q": scale | (scale, offset), ...}}``
with ``[H]`` scales in the FA modes, ``{attn: {"k": scale, "v": scale}}`` in ``c8``
/ ``fp8_kv``. ``None`` means *dynamic* scales: when a sequence starts (its
prefill), each layer takes the absmax of the prompt's K and V (and Q for FAQuant)
over all batch rows and tokens -- per head, per channel for ``c8`` --
``scale = max(absmax / 127, 2**-23)`` (:func:`~ascend_fa.atb_ops.per_head_qparams`;
``absmax / 448`` for FP8), and keeps it for the rest of the sequence; later tokens
outside that range saturate, as they would with a static scale. Dynamic scales are a CI
convenience: a short prompt is a one-sample calibration, which suits K/V but often
not Q (FAQuant); use an artifact's scales for FAQuant accuracy numbers.

Usage (the handle also works as a context manager)::

    rt = enable_paged_int8_attention(model, mode="int8_kv", scales="artifact/")
    ids = rt.generate(prompt_ids, max_new_tokens=64)       # greedy, [B, S + N]
    ppl = rt.perplexity(windows)                           # prefill path
    rt.remove()                                            # model as before

Calling ``model(...)`` directly while enabled also goes through the paged cache: a
call whose HF cache is empty starts new sequences (a whole-window forward with
``use_cache=False`` is one prefill), and a call with HF's cache (e.g.
``model.generate``) continues them. Batches: ``B`` sequences of equal length; a 2-D
``attention_mask`` with padding is refused (left padding would need per-sequence
positions). Sliding-window attention is not emulated: a sequence longer than the
config's active ``sliding_window`` is refused (up to it, a sliding layer attends
every earlier token, as a full layer does; Gemma 3's ``layer_types`` say which
layers slide).

The paged cache holds the only K/V the attention reads; with ``num_blocks=None`` it
starts small and doubles when full (copying the used blocks), with ``num_blocks`` set
it is fixed and running out raises.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.hf import register_attention_function
from ascend_fa.atb_ops import c0
from ascend_fa.atb_ops.quant import check_fp8_rounding
from ascend_fa.attention import paged_attention, prefill_attention, reshape_and_cache
from ascend_fa.backends import Backend, get_backend
from ascend_fa.families import attention_kind, model_types
from ascend_fa.kvcache import CacheBatch, PagedKVCache
from ascend_fa.metrics import token_nll

from .scales import cache_mode, dynamic_layer_scales, dynamic_scales, load_scales

__all__ = [
    "EMULATION_MODES",
    "PAGED_ATTENTION_IMPL",
    "SUPPORTED_MODEL_TYPES",
    "QuantizedKVRuntime",
    "enable_paged_int8_attention",
    "dynamic_scales",
]

#: Attention implementation name registered in transformers' ``AttentionInterface``.
PAGED_ATTENTION_IMPL = "ascend_fa_paged"
EMULATION_MODES = ("float", "int8_kv", "faquant", "c8", "fp8_kv")
#: The model types whose family (:mod:`ascend_fa.families`) the emulation runs.
SUPPORTED_MODEL_TYPES = model_types(paged_emulation=True)

_RT_ATTR = "_ascend_fa_paged_runtime"
_ROOT_ATTR = "_ascend_fa_paged_root_runtime"


def _attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``query`` ``[B, H, S, D]``, ``key``/``value``
    ``[B, Hkv, L, D]`` -> ``([B, S, H, D], None)``. The causal structure comes from
    the paged cache's positions, so ``attention_mask`` is not used."""
    runtime: QuantizedKVRuntime | None = module.__dict__.get(_RT_ATTR)
    if runtime is None:
        raise RuntimeError(
            f"{PAGED_ATTENTION_IMPL}: attention module {type(module).__name__} was "
            "not prepared by enable_paged_int8_attention"
        )
    if dropout:
        raise ValueError(
            f"{PAGED_ATTENTION_IMPL}: attention dropout {dropout} is not supported "
            "(put the model in eval mode)"
        )
    return runtime._attend(module, query, key, value, scaling), None


def _register() -> None:
    # No mask function is registered on purpose: transformers then builds no mask,
    # which is right because the paged kernels apply causality from positions.
    register_attention_function(PAGED_ATTENTION_IMPL, _attention_forward)


def _is_attention(module: nn.Module) -> bool:
    return all(
        hasattr(module, a)
        for a in ("q_proj", "k_proj", "v_proj", "head_dim", "num_key_value_groups",
                  "config", "layer_idx")
    )  # fmt: skip


class QuantizedKVRuntime:
    """The paged-cache runtime of one model; made by
    :func:`enable_paged_int8_attention` (see the module doc for the semantics).

    Attributes: ``mode``; ``cache`` (the :class:`PagedKVCache`, ``None`` before the
    first step); ``layer_names`` (dotted names of the attention modules, in layer
    order); ``static`` (True when the scales came from an artifact or map).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str = "int8_kv",
        scales: str | Path | Mapping[str, Any] | None = None,
        block_size: int = 128,
        num_blocks: int | None = None,
        backend: str | Backend | None = None,
        fp8_rounding: str = "nearest",
    ) -> None:
        if mode not in EMULATION_MODES:
            raise ValueError(f"mode must be one of {EMULATION_MODES}, got {mode!r}")
        check_fp8_rounding("enable_paged_int8_attention", fp8_rounding)
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        kind = attention_kind(model_type)
        if "linear_attention" in (getattr(config, "layer_types", None) or ()):
            raise ValueError(
                f"model type {model_type!r} is not supported by the paged "
                "emulation: its linear_attention layers (Gated DeltaNet) carry a "
                "recurrent state between decode steps that the paged runtime does "
                "not keep (only softmax K/V); use ascend-fa eval for its accuracy"
            )
        if kind is None or not kind.paged_emulation:
            raise ValueError(
                f"model type {model_type!r} is not supported by the paged emulation "
                f"(supported: {', '.join(model_types(paged_emulation=True))})"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                f"model type {model_type!r} with use_bidirectional_attention: its "
                "tokens attend later tokens too, and the paged kernels are causal"
            )
        if model.__dict__.get(_ROOT_ATTR) is not None:
            raise ValueError(
                "paged attention is already enabled on this model; call .remove() on "
                "its handle first"
            )
        int8 = mode != "float"
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ValueError(f"block_size must be an int, got {block_size!r}")
        step = 32 if int8 else 16
        if block_size <= 0 or block_size % step:
            raise ValueError(
                f"block_size must be a positive multiple of {step} for mode "
                f"{mode!r} (paged blocks are whole NZ fractals: 16 rows, 32 for "
                f"1-byte int8 / fp8 caches), got {block_size}"
            )
        if num_blocks is not None and (
            isinstance(num_blocks, bool)
            or not isinstance(num_blocks, int)
            or num_blocks <= 0
        ):
            raise ValueError(
                f"num_blocks must be None or a positive int, got {num_blocks!r}"
            )
        if scales is not None and not int8:
            raise ValueError("mode 'float' quantizes nothing; it takes no scales")

        modules = [(n, m) for n, m in model.named_modules() if _is_attention(m)]
        if not modules:
            raise ValueError(
                f"no attention modules with q_proj/k_proj/v_proj found in "
                f"{type(model).__name__}"
            )
        self.model = model
        self.mode = mode
        self.fp8_rounding = fp8_rounding
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = (
            backend
            if isinstance(backend, Backend)
            else (get_backend(backend) if backend is not None else None)
        )
        self.layer_names = [n for n, _ in modules]
        self._modules = [m for _, m in modules]
        self._layer_of = {id(m): i for i, (_, m) in enumerate(modules)}
        cfg = self._modules[0].config
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(
            getattr(cfg, "num_key_value_heads", None) or self.num_heads
        )
        self.head_dim = int(self._modules[0].head_dim)
        width = self.num_kv_heads * self.head_dim
        dtype = next(model.parameters()).dtype
        cols = c0(torch.int8 if int8 else dtype)
        if width % cols:
            raise ValueError(
                f"Hkv*D = {self.num_kv_heads}*{self.head_dim} = {width} is not a "
                f"multiple of C0 = {cols}: the NZ cache cannot hold this model"
            )
        window = getattr(cfg, "sliding_window", None)
        # Gemma 3 names each layer's type: the window binds its sliding layers only
        types = list(getattr(cfg, "layer_types", None) or [])
        n = types.count("sliding_attention")
        self._sliding = f" ({n} of its {len(types)} layers)" if types else ""
        self._window = (
            int(window)
            if window
            and getattr(cfg, "use_sliding_window", True)
            and (not types or "sliding_attention" in types)
            else None
        )

        self.static = scales is not None
        self._scales: list[dict[str, torch.Tensor]] = (
            load_scales(
                scales,
                mode=mode,
                layer_names=self.layer_names,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
            )  # fmt: skip
            if scales is not None
            else []
        )
        self.cache: PagedKVCache | None = None
        self._seq_ids: tuple[int, ...] = ()
        self._next_seq = 0
        self._dynamic: list[dict[str, torch.Tensor] | None] = [None] * len(modules)
        self._batch: CacheBatch | None = None
        self._step_layers: set[int] = set()
        self._explicit_past: int | None = None

        _register()
        self._configs: list[tuple[Any, str | None]] = []
        for m in self._modules:
            if all(c is not m.config for c, _ in self._configs):
                self._configs.append((m.config, m.config._attn_implementation))
        self._handles = [
            model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            model.register_forward_hook(self._post_hook, always_call=True),
        ]
        for m in self._modules:
            m.__dict__[_RT_ATTR] = self
        model.__dict__[_ROOT_ATTR] = self
        for c, _ in self._configs:
            c._attn_implementation = PAGED_ATTENTION_IMPL
        self._removed = False

    # -- scales -------------------------------------------------------------------
    def layer_scales(self, layer: int) -> dict[str, torch.Tensor]:
        """``{"k", "v"[, "q"]}`` fp32 in use for ``layer`` (static, or the current
        sequences' dynamic ones; empty in float mode or before a dynamic prefill):
        ``[Hkv]`` (``q`` ``[H]``), C8 ``[Hkv, D]``, FP8 ``[1]`` or ``[Hkv]``."""
        if self.mode == "float":
            return {}
        if self.static:
            return dict(self._scales[layer])
        return dict(self._dynamic[layer] or {})

    # -- hooks and the attention step ---------------------------------------------
    def _pre_hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            mask = args[1]
        if (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and not bool(mask.bool().all())
        ):
            raise ValueError(
                f"{PAGED_ATTENTION_IMPL}: padded batches are not supported (the "
                "attention_mask has zeros); run sequences of equal length together"
            )
        self._batch = None

    def _post_hook(self, _module: nn.Module, _args: tuple, _out: Any) -> None:
        self._batch = None
        self._explicit_past = None

    def reset(self) -> None:
        """Forget every sequence (free their blocks and dynamic scales)."""
        if self.cache is not None:
            for sid in self._seq_ids:
                self.cache.free(sid)
        self._seq_ids = ()
        self._dynamic = [None] * len(self._modules)

    def _grow(self, need_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        """A cache with at least ``need_blocks`` free blocks; live sequences are
        copied block by block into the new one (only when ``num_blocks`` is None)."""
        old = self.cache
        fits = (
            old is not None
            and old.dtype == dtype
            and old.device == device
            and old.num_free_blocks >= need_blocks
        )
        if fits:
            return
        if old is not None and self.num_blocks is not None and old.dtype == dtype:
            raise ValueError(
                f"{PAGED_ATTENTION_IMPL}: out of cache blocks: need {need_blocks}, "
                f"{old.num_free_blocks} free of num_blocks={self.num_blocks}; pass a "
                "larger num_blocks (or None to grow on demand)"
            )
        used = 0 if old is None else old.num_blocks - old.num_free_blocks
        # Growing by doubling keeps the copies amortized O(1) per token.
        total = self.num_blocks or max(
            used + need_blocks, 0 if old is None else 2 * old.num_blocks
        )
        if self.num_blocks is not None and need_blocks > total:
            raise ValueError(
                f"{PAGED_ATTENTION_IMPL}: out of cache blocks: need {need_blocks} of "
                f"num_blocks={total}; pass a larger num_blocks"
            )
        cache = PagedKVCache(
            len(self._modules), self.num_kv_heads, self.head_dim,
            num_blocks=total, block_size=self.block_size, dtype=dtype,
            mode=cache_mode(self.mode), backend=self.backend, device=device,
        )  # fmt: skip
        live = [i for i in self._seq_ids if old is not None and old.seq_len(i)]
        if live and (old.dtype != dtype or old.device != device):
            raise RuntimeError(
                f"{PAGED_ATTENTION_IMPL}: the activations changed to {dtype} on "
                f"{device} in the middle of a sequence (cache: {old.dtype} on "
                f"{old.device}); start a new sequence"
            )
        for sid in live:
            cache.append([sid], old.seq_len(sid))
            src = torch.tensor(old.blocks_of(sid), dtype=torch.long)
            dst = torch.tensor(cache.blocks_of(sid), dtype=torch.long)
            for i in range(len(self._modules)):
                for a, b in zip(cache.layer(i), old.layer(i)):
                    a[dst.to(a.device)] = b[src.to(b.device)]
        self.cache = cache

    def _begin_step(self, b: int, s: int, past: int, key: torch.Tensor) -> None:
        if past == 0:
            self.reset()
            self._seq_ids = tuple(range(self._next_seq, self._next_seq + b))
            self._next_seq += b
        else:
            held = [self.cache.seq_len(i) for i in self._seq_ids] if self.cache else []
            if len(held) != b or any(n != past for n in held):
                raise RuntimeError(
                    f"{PAGED_ATTENTION_IMPL}: the paged cache holds {held} tokens for "
                    f"its sequences but this step continues {b} sequence(s) after "
                    f"{past} tokens; start a new sequence (reset) instead"
                )
        if self._window is not None and past + s > self._window:
            raise ValueError(
                f"{PAGED_ATTENTION_IMPL}: {past + s} tokens exceed the model's "
                f"sliding_window {self._window}{self._sliding}, which the paged "
                f"kernels do not apply; run sequences of at most {self._window} tokens"
            )
        bs = self.block_size
        have = (
            [len(self.cache.blocks_of(i)) for i in self._seq_ids]
            if self.cache is not None
            else [0] * b
        )
        need = sum(max(0, -(-(past + s) // bs) - h) for h in have)
        cache_dtype = key.dtype
        self._grow(need, cache_dtype, key.device)
        self._batch = self.cache.append(self._seq_ids, s)

    def _attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        b, h, s, d = query.shape
        hkv, length = key.shape[1], key.shape[2]
        layer = self._layer_of[id(module)]
        # A layer seen twice means a new forward began without the root's hooks
        # (e.g. the inner decoder was called directly): that is a new step too.
        if self._batch is None or layer in self._step_layers:
            self._step_layers.clear()
            past = (
                self._explicit_past if self._explicit_past is not None else length - s
            )
            self._begin_step(b, s, past, key)
        self._step_layers.add(layer)
        batch = self._batch
        k_new = key[:, :, length - s :]
        v_new = value[:, :, length - s :]
        sc: dict[str, torch.Tensor] = {}
        if self.mode != "float":
            if self.static:
                sc = self._scales[layer]
            else:
                if self._dynamic[layer] is None:
                    # First step of the sequences: scales from the prompt itself.
                    self._dynamic[layer] = dynamic_layer_scales(
                        self.mode, query, k_new, v_new
                    )
                sc = self._dynamic[layer]
            sc = {n: t.to(query.device) for n, t in sc.items()}
            if self.mode == "fp8_kv" and self.fp8_rounding == "trunc":
                # vLLM's CPU kernel takes one scale per layer, the max of [Hkv]
                # (FP8FakeQuant in ascend_fa/calibration/kv.py cites the loader)
                sc = {n: t.max().reshape(1) for n, t in sc.items()}
        k_scale, v_scale, q_scale = sc.get("k"), sc.get("v"), sc.get("q")
        key_cache, value_cache = self.cache.layer(layer)
        layout = self.cache.layout
        reshape_and_cache(
            k_new.transpose(1, 2).reshape(b * s, hkv, d),
            v_new.transpose(1, 2).reshape(b * s, hkv, d),
            key_cache, value_cache, batch.slot_mapping,
            k_scale=k_scale, v_scale=v_scale, layout=layout,
            fp8_rounding=self.fp8_rounding, backend=self.backend,
        )  # fmt: skip
        scale = float(scaling if scaling is not None else module.scaling)
        common = dict(
            num_kv_heads=hkv, scale=scale, k_scale=k_scale, v_scale=v_scale,
            q_scale=q_scale, layout=layout, backend=self.backend,
        )  # fmt: skip
        if s == 1:
            out = paged_attention(
                query[:, :, 0].contiguous(), key_cache, value_cache,
                batch.block_table, batch.seq_lens, **common,
            )  # fmt: skip
            return out.unsqueeze(1)
        return prefill_attention(
            query.transpose(1, 2).contiguous(), key_cache, value_cache,
            batch.block_table, batch.seq_lens, query_lens=batch.query_lens, **common,
        )  # fmt: skip

    # -- engine verbs -------------------------------------------------------------
    def _check_live(self) -> None:
        if self._removed:
            raise RuntimeError("this paged-attention handle was removed")

    def _ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise ValueError("input_ids must be an integer tensor [B, S] or [S]")
        ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [B, S] with S >= 1, got {tuple(input_ids.shape)}"
            )
        return ids.to(next(self.model.parameters()).device)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, *, new_sequence: bool = False
    ) -> torch.Tensor:
        """One engine step: ``input_ids`` ``[B, S]`` are the next tokens of the current
        sequences (or of ``B`` new ones when ``new_sequence`` or none are held);
        returns the logits ``[B, S, V]``. Positions continue from the cache."""
        self._check_live()
        ids = self._ids(input_ids)
        b, s = ids.shape
        fresh = new_sequence or not self._seq_ids
        if not fresh and len(self._seq_ids) != b:
            raise ValueError(
                f"forward: {b} rows but {len(self._seq_ids)} sequences are held; "
                "pass new_sequence=True to start over"
            )
        past = 0 if fresh else self.cache.seq_len(self._seq_ids[0])
        positions = torch.arange(past, past + s, device=ids.device).expand(b, s)
        self._explicit_past = past
        try:
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False)
        finally:
            self._explicit_past = None
        return out.logits

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding of ``B`` new sequences: prefill ``input_ids`` ``[B, S]``
        (or ``[S]``), then one :func:`paged_attention` step per new token. Returns
        ``[B, S + N]`` with ``N <= max_new_tokens`` (stops when every row has
        produced ``eos_token_id``; finished rows repeat it)."""
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or (max_new_tokens < 0)
        ):
            raise ValueError(
                f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}"
            )
        ids = self._ids(input_ids)
        if max_new_tokens == 0:
            return ids.clone()
        logits = self.forward(ids, new_sequence=True)
        out = [ids]
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for i in range(max_new_tokens):
            nxt = logits[:, -1].argmax(dim=-1)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            out.append(nxt[:, None])
            if i + 1 == max_new_tokens or bool(done.all()):
                break
            logits = self.forward(nxt[:, None])
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def perplexity(self, windows: torch.Tensor | Sequence[torch.Tensor]) -> float:
        """``exp(mean next-token NLL)`` over ``windows`` (token ids ``[S]`` each, or a
        ``[N, S]`` tensor); every window is one prefill of a new sequence, so
        dynamic scales come from the window itself."""
        self._check_live()
        rows = (
            list(windows)
            if not isinstance(windows, torch.Tensor)
            else ([windows] if windows.dim() == 1 else list(windows))
        )
        total, count = 0.0, 0
        for w in rows:
            ids = self._ids(w)
            if ids.shape[1] < 2:
                raise ValueError("perplexity: every window needs >= 2 tokens")
            logits = self.forward(ids, new_sequence=True)
            n, c = token_nll(logits, ids)
            total += n
            count += c
        if not count:
            raise ValueError("perplexity: no windows")
        self.reset()
        return math.exp(total / count)

    def remove(self) -> None:
        """Restore the model exactly (attention implementation, no hooks or
        attributes left) and drop the cache. Calling it twice is harmless."""
        if self._removed:
            return
        for handle in self._handles:
            handle.remove()
        for m in self._modules:
            m.__dict__.pop(_RT_ATTR, None)
        self.model.__dict__.pop(_ROOT_ATTR, None)
        for config, original in self._configs:
            config._attn_implementation = original
        self.cache = None
        self._seq_ids = ()
        self._removed = True

    def __enter__(self) -> QuantizedKVRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"QuantizedKVRuntime(mode={self.mode!r}, layers={len(self._modules)}, "
            f"H={self.num_heads}, Hkv={self.num_kv_heads}, D={self.head_dim}, "
            f"BS={self.block_size}, scales={'static' if self.static else 'dynamic'}, "
            f"cache={self.cache!r})"
        )


def enable_paged_int8_attention(
    model: nn.Module,
    *,
    mode: str = "int8_kv",
    scales: str | Path | Mapping[str, Any] | None = None,
    block_size: int = 128,
    num_blocks: int | None = None,
    backend: str | Backend | None = None,
    fp8_rounding: str = "nearest",
) -> QuantizedKVRuntime:
    """Route ``model``'s attention through the paged cache and return the handle.

    Args:
        model: a transformers LLaMA / Qwen2 / Qwen3 / Mistral causal LM.
        mode: ``"int8_kv"`` (int8 cache, float query), ``"faquant"`` (query
            quantized too, needs ``fa_q`` scales), ``"c8"`` (int8 cache with
            per-channel scales, vllm-ascend), ``"fp8_kv"`` (FP8 E4M3 cache, vLLM)
            or ``"float"`` (float cache).
        scales: artifact directory, scale map, or None for dynamic scales from
            each sequence's prompt (see the module doc).
        block_size: ``BS`` tokens per block (multiple of 32 for int8 / fp8, 16 for
            float).
        num_blocks: fixed cache size in blocks, or None to grow on demand.
        backend: backend name or instance for every op (default: selected per op).
        fp8_rounding: how ``"fp8_kv"`` writes the cache: ``"nearest"`` (vLLM on
            CUDA) or ``"trunc"`` (vLLM on CPU: toward zero, and one scale per
            layer, the max of a per-head ``[Hkv]`` scale, as its kernel takes).
    """
    return QuantizedKVRuntime(
        model, mode=mode, scales=scales, block_size=block_size,
        num_blocks=num_blocks, backend=backend, fp8_rounding=fp8_rounding,
    )  # fmt: skip
