"""The paged emulation runtime and ``emulate`` with C8 (vllm-ascend) and FP8 E4M3
(vLLM) KV caches, read from artifacts as those consumers load them.

References are independent of the package: HF's own SDPA attention on K/V
fake-quantized by the consumer's rule written out here in fp64, and a per-element
Python loop for the cache codes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ascend_fa.atb_ops.cache import token_rows_ref
from safetensors.torch import save_file
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from ascend_fa.emulation import enable_paged_int8_attention
from ascend_fa.hf_compat import cache_kwargs, output_cache

VOCAB = 128
ATOL = 1e-4
HKV, D = 2, 32


def _tiny(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=HKV, head_dim=D,
        max_position_embeddings=512,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper attention, so KV error moves the logits
        for name, p in model.named_parameters():
            if "proj" in name and p.dim() == 2:
                p.mul_(4.0)
    return model.to(dtype).eval()


def _ids(s: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, s), generator=g)


def _decode_tokens(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (1, 1), generator=g) for _ in range(steps)]


# -- independent fake-quant forms ------------------------------------------------------
def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    low = torch.floor(x)
    frac = x - low
    odd = torch.remainder(low, 2) == 1
    return low + ((frac > 0.5) | ((frac == 0.5) & odd)).double()


def c8_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vllm-ascend C8 on ``x`` ``[B, Hkv, T, D]``, ``scale`` ``[Hkv, D]``: scale held
    in ``x``'s dtype, reciprocal and product rounded to it, ties to even,
    saturate; dequantized with the held scale."""
    held = scale.to(x.dtype).double().view(1, HKV, 1, D)
    inv = (1.0 / held).to(x.dtype).double()
    prod = (x.double() * inv).to(x.dtype).double()
    codes = _round_half_even(prod).clamp(-128, 127)
    return (codes * held).to(x.dtype)


def fp8_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM FP8 E4M3 on ``x`` ``[B, Hkv, T, D]`` with ``[1]`` or ``[Hkv]`` scales."""
    s = scale.double().view(1, -1, 1, 1)
    y = (x.double() / s).clamp(-448, 448).float()
    return (y.to(torch.float8_e4m3fn).double() * s).to(x.dtype)


def fp8_trunc_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU FP8 cache: one scale per layer (the max of ``[Hkv]``), ``y = x *
    (1 / s)`` in fp32 saturated at 448, kept to E4M3's 3 mantissa bits toward zero
    (``frexp``; below 2**-6 the step is E4M3's subnormal 2**-9)."""
    s = scale.float().max()
    y = (x.float() * (1.0 / s)).clamp(-448, 448).double()
    _, e = torch.frexp(y)  # |y| = m * 2**e, m in [0.5, 1)
    step = torch.exp2((e.clamp(min=-5) - 4).double())
    codes = torch.trunc(y / step) * step
    return (codes * s.double()).to(x.dtype)


_REF: dict = {}


def _reference_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sc = _REF["scales"][module.layer_idx]
    fq = {"c8": c8_fake_quant, "fp8_kv": fp8_fake_quant}.get(
        _REF["mode"], fp8_trunc_fake_quant
    )
    key, value = fq(key, sc["k"]), fq(value, sc["v"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("test_kv_formats_ref", _reference_attention)


@torch.no_grad()
def _reference_steps(model, ids, steps, mode, scales):
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register("test_kv_formats_ref", sdpa_mask)
    _REF.update(mode=mode, scales=scales)
    old = model.config._attn_implementation
    model.config._attn_implementation = "test_kv_formats_ref"
    try:
        out = model(input_ids=ids, use_cache=True)
        logits, cache = [out.logits], output_cache(out)
        for t in _decode_tokens(steps):
            out = model(input_ids=t, **cache_kwargs(cache), use_cache=True)
            logits.append(out.logits)
            cache = output_cache(out)
        return logits
    finally:
        model.config._attn_implementation = old


@torch.no_grad()
def _paged_steps(rt, ids, steps):
    logits = [rt.forward(ids, new_sequence=True)]
    for t in _decode_tokens(steps):
        logits.append(rt.forward(t))
    return logits


def _calibrated(model, mode: str, shrink: float = 0.8) -> list[dict]:
    """Scales from another input's dynamic run, shrunk so some values saturate."""
    with enable_paged_int8_attention(model, mode=mode, block_size=32) as rt:
        rt.forward(_ids(29, seed=5), new_sequence=True)
        return [
            {n: t * shrink for n, t in rt.layer_scales(i).items()} for i in range(2)
        ]


def _write_artifact(path: Path, tensors: dict, dtype: str = "float32") -> Path:
    path.mkdir()
    save_file(tensors, str(path / "quant_model_weights.safetensors"))
    (path / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    return path


def _c8_artifact(path: Path, scales: list[dict]) -> Path:
    """vllm-ascend C8 tensors: ``<attn>.{k,v}_proj.kv_cache_{scale,offset}``
    ``[Hkv*D]`` in channel order ``h*D + d``, offsets 0."""
    tensors = {}
    for i, sc in enumerate(scales):
        attn = f"model.layers.{i}.self_attn"
        for side in ("k", "v"):
            flat = sc[side].reshape(-1).contiguous()
            tensors[f"{attn}.{side}_proj.kv_cache_scale"] = flat
            tensors[f"{attn}.{side}_proj.kv_cache_offset"] = torch.zeros_like(flat)
    return _write_artifact(path, tensors)


def _fp8_artifact(path: Path, scales: list[dict]) -> Path:
    """vLLM FP8 KV tensors ``<attn>.{k,v}_scale`` fp32."""
    tensors = {
        f"model.layers.{i}.self_attn.{side}_scale": sc[side].contiguous()
        for i, sc in enumerate(scales)
        for side in ("k", "v")
    }
    return _write_artifact(path, tensors)


# -- the runtime ----------------------------------------------------------------------
def test_c8_artifact_matches_independent_fake_quant(tmp_path):
    model = _tiny()
    scales = _calibrated(model, "c8")
    assert tuple(scales[0]["k"].shape) == (HKV, D)
    art = _c8_artifact(tmp_path / "c8", scales)
    ids = _ids(41)
    with enable_paged_int8_attention(model, mode="c8", scales=art) as rt:
        got = _paged_steps(rt, ids, 5)
        assert rt.static
        torch.testing.assert_close(rt.layer_scales(1)["v"], scales[1]["v"])
    want = _reference_steps(model, ids, 5, "c8", scales)
    plain = _reference_steps(model, ids, 0, "c8", [_unit(s) for s in scales])
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= ATOL
    # and the quantization is visible: not the float model
    assert float((got[0] - plain[0]).abs().max()) > 10 * ATOL


def _unit(sc: dict) -> dict:
    """Scales so fine that fake-quant is the identity up to rounding (a float run
    through the reference path)."""
    return {n: torch.full_like(t, 2.0**-12) for n, t in sc.items()}


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_artifact_matches_independent_fake_quant(tmp_path, per_head):
    model = _tiny()
    scales = _calibrated(model, "fp8_kv", shrink=0.5)
    if not per_head:  # per tensor: the max over heads, as vLLM's "tensor" strategy
        scales = [{n: t.amax().reshape(1) for n, t in sc.items()} for sc in scales]
    art = _fp8_artifact(tmp_path / "fp8", scales)
    ids = _ids(37)
    with enable_paged_int8_attention(model, mode="fp8_kv", scales=art) as rt:
        got = _paged_steps(rt, ids, 4)
        assert rt.cache.key_caches[0].dtype == torch.float8_e4m3fn
    want = _reference_steps(model, ids, 4, "fp8_kv", scales)
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= ATOL


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_trunc_matches_independent_fake_quant(tmp_path, per_head):
    """``fp8_rounding="trunc"``: vLLM's CPU cache, toward zero with one scale per
    layer (a per-head artifact runs with the max of its heads)."""
    model = _tiny()
    scales = _calibrated(model, "fp8_kv", shrink=0.5)
    if not per_head:
        scales = [{n: t.amax().reshape(1) for n, t in sc.items()} for sc in scales]
    art = _fp8_artifact(tmp_path / "fp8", scales)
    ids = _ids(37)
    kw = dict(mode="fp8_kv", scales=art)
    with enable_paged_int8_attention(model, fp8_rounding="trunc", **kw) as rt:
        got = _paged_steps(rt, ids, 4)
    with enable_paged_int8_attention(model, **kw) as rt:
        nearest = _paged_steps(rt, ids, 4)
    want = _reference_steps(model, ids, 4, "fp8_trunc", scales)
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= ATOL
    assert float((got[0] - nearest[0]).abs().max()) > 10 * ATOL


@pytest.mark.parametrize("mode", ["c8", "fp8_kv"])
def test_dynamic_scales_come_from_the_prompt(mode, monkeypatch):
    """Without an artifact each layer takes its scales from the prompt's K / V
    (per channel / 127 for C8, per head / 448 for FP8) and keeps them for decode."""
    import ascend_fa.emulation.runtime as runtime

    model = _tiny()
    ids = _ids(33)
    seen = []
    real = runtime.reshape_and_cache

    def record(key, value, *args, **kw):
        seen.append((key.clone(), value.clone()))
        real(key, value, *args, **kw)

    monkeypatch.setattr(runtime, "reshape_and_cache", record)
    with enable_paged_int8_attention(model, mode=mode, block_size=32) as rt:
        got = _paged_steps(rt, ids, 3)
        scales = [rt.layer_scales(i) for i in range(2)]
    for layer in range(2):
        key, value = seen[layer]  # the prompt's K / V [S, Hkv, D] of this layer
        for side, x in (("k", key), ("v", value)):
            if mode == "c8":
                want = (x.abs().amax(dim=0) / 127).clamp(min=2.0**-23)
            else:
                want = (x.abs().amax(dim=(0, 2)) / 448).clamp(
                    min=torch.finfo(torch.float32).tiny
                )
            torch.testing.assert_close(scales[layer][side], want, rtol=0, atol=0)
    want = _reference_steps(model, ids, 3, mode, scales)
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c8_cache_codes_bit_equal_a_naive_loop(dtype, monkeypatch):
    """The codes the runtime writes for a prompt and a decode step, element by
    element from the K/V it hands the cache write and the scales in use."""
    import ascend_fa.emulation.runtime as runtime

    model = _tiny(dtype)
    ids = _ids(45)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real = runtime.reshape_and_cache

    def record(key, value, key_cache, value_cache, slot_mapping, **kw):
        seen.append((key.clone(), value.clone(), slot_mapping.clone()))
        real(key, value, key_cache, value_cache, slot_mapping, **kw)

    monkeypatch.setattr(runtime, "reshape_and_cache", record)
    with enable_paged_int8_attention(model, mode="c8", block_size=32) as rt:
        rt.forward(ids, new_sequence=True)
        rt.forward(_ids(1, seed=9))
        assert len(seen) == 4  # two layers, two steps
        for i, (key, value, slots) in enumerate(seen):
            layer = i % 2
            sc = rt.layer_scales(layer)
            caches = rt.cache.layer(layer)
            for cache, x, s in zip(caches, (key, value), (sc["k"], sc["v"])):
                for t in range(0, slots.numel(), 3):  # every 3rd token, all channels
                    got = token_rows_ref(cache, int(slots[t]), rt.cache.layout)
                    want = [
                        _code(float(x[t, h, d]), float(s[h, d]), dtype)
                        for h in range(HKV)
                        for d in range(D)
                    ]
                    assert got.tolist() == want, (layer, t)


def _code(x: float, scale: float, dtype: torch.dtype) -> int:
    """One C8 code by hand: held scale, reciprocal and product rounded to
    ``dtype``, round half to even, saturate."""

    def rnd(v: float) -> float:
        return float(torch.tensor(v, dtype=torch.float64).to(dtype))

    held = rnd(scale)
    prod = rnd(x * rnd(1.0 / held))
    low = math.floor(prod)
    frac = prod - low
    q = low + (1 if frac > 0.5 or (frac == 0.5 and low % 2) else 0)
    return max(-128, min(127, q))


def test_scales_that_do_not_fit_are_refused(tmp_path):
    model = _tiny()
    scales = _calibrated(model, "c8")
    c8 = _c8_artifact(tmp_path / "c8", scales)
    fp8 = _fp8_artifact(
        tmp_path / "fp8",
        [{n: t.amax().reshape(1) for n, t in sc.items()} for sc in scales],
    )
    with pytest.raises(ValueError, match="mode 'fp8_kv' reads .*has c8 KV-cache"):
        enable_paged_int8_attention(model, mode="fp8_kv", scales=c8)
    with pytest.raises(ValueError, match="has no <attn>.fa_"):
        enable_paged_int8_attention(model, mode="int8_kv", scales=fp8)
    bad = {f"model.layers.{i}.self_attn": dict(sc) for i, sc in enumerate(scales)}
    bad["model.layers.1.self_attn"]["v"] = torch.ones(HKV * D + 1)
    with pytest.raises(ValueError, match=r"self_attn.v C8 scale has 65 values.*2\*32"):
        enable_paged_int8_attention(model, mode="c8", scales=bad)
    bad["model.layers.1.self_attn"]["v"] = -torch.ones(HKV, D)
    with pytest.raises(ValueError, match="finite and > 0"):
        enable_paged_int8_attention(model, mode="c8", scales=bad)
    bad = {f"model.layers.{i}.self_attn": {"k": torch.ones(1), "v": torch.ones(2)}
           for i in range(2)}  # fmt: skip
    bad["model.layers.1.self_attn"]["v"] = torch.ones(3)
    with pytest.raises(ValueError, match="layers.1.self_attn.v FP8 scale has 3 values"):
        enable_paged_int8_attention(model, mode="fp8_kv", scales=bad)
    assert model.config._attn_implementation == "sdpa"  # nothing left enabled


# -- the verb -------------------------------------------------------------------------
def _checkpoint(path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a keeper light house sea night storm ship rock lamp she went".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", pad_token="[UNK]", eos_token="[UNK]"
    ).save_pretrained(path)
    _tiny().save_pretrained(path)
    g = torch.Generator().manual_seed(3)
    return " ".join(
        words[int(i)] for i in torch.randint(0, len(words), (60,), generator=g)
    )


def test_cli_emulate_runs_the_mode_the_artifact_deploys(tmp_path, capsys):
    from ascend_fa.cli import main

    text = _checkpoint(tmp_path / "model")
    (tmp_path / "eval.txt").write_text(text)
    scales = _calibrated(_tiny(), "c8")
    arts = {
        "c8": _c8_artifact(tmp_path / "c8", scales),
        "fp8_kv": _fp8_artifact(tmp_path / "fp8", _calibrated(_tiny(), "fp8_kv")),
    }
    common = [
        "emulate", "--model", str(tmp_path / "model"), "--prompt",
        "the keeper went to the light house", "--max-new-tokens", "4",
        "--eval-data", str(tmp_path / "eval.txt"), "--window", "24",
        "--block-size", "32",
    ]  # fmt: skip
    for mode, art in arts.items():
        out = tmp_path / f"{mode}.json"
        assert main([*common, "--artifact", str(art), "--json", str(out)]) == 0
        printed = capsys.readouterr().out
        rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
        assert list(rows) == ["float (plain model)", "float-paged", mode]
        assert rows[mode]["scales"] == "artifact" and mode in printed
        # a random tiny model has near-tied logits: KL is the figure to bound
        assert 0 < rows[mode]["kl"] < 0.05 and 0.5 <= rows[mode]["top1"] <= 1.0
        assert rows[mode]["ppl"] != rows["float-paged"]["ppl"]
    rc = main([*common, "--artifact", str(arts["c8"]), "--mode", "faquant"])
    assert rc == 2
    assert "--mode faquant does not fit the artifact: its C8 scales run c8" in (
        capsys.readouterr().err
    )
    (tmp_path / "empty").mkdir()
    save_file(
        {"x": torch.ones(1)}, str(tmp_path / "empty/quant_model_weights.safetensors")
    )
    assert main([*common, "--artifact", str(tmp_path / "empty")]) == 2
    assert "has no FA or KV-cache scales" in capsys.readouterr().err
