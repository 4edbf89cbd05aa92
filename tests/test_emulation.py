"""Whole-model emulation through the paged cache (ascend_fa.emulation).

Budgets (fp32 throughout):

* ``mode="float"`` against the plain model: the paged kernels compute the same
  attention in fp32 with another summation order, so logits agree to
  ``FLOAT_ATOL`` (measured max |diff| ~2e-7 on these models).
* int8 modes against an independent computation — the same model with a plain HF
  attention function that fake-quantizes K/V (and Q for FAQuant) with
  ``quantize_per_head``/``dequantize_per_head`` — agree to ``INT8_ATOL``: the codes
  are identical, only fp32 summation order differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ascend_fa.atb_ops import dequantize_per_head, quantize_per_head
from safetensors.torch import save_file
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ascend_fa.emulation import (
    PAGED_ATTENTION_IMPL,
    QuantizedKVRuntime,
    dynamic_scales,
    enable_paged_int8_attention,
)
from ascend_fa.hf_compat import cache_kwargs, output_cache

FLOAT_ATOL = 2e-5
INT8_ATOL = 1e-4
VOCAB = 128


def _tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512,
    )  # fmt: skip
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    # Larger-than-init weights so attention is not nearly uniform and int8 error
    # actually moves the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name and p.dim() == 2:
                p.mul_(4.0)
    return model.eval()


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return _tiny(request.param)


def _ids(b: int, s: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g)


@torch.no_grad()
def _plain_steps(model, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits of a prefill and ``steps`` teacher-forced decode steps (the decode
    tokens are fixed, so both paths see the same inputs), with HF's own cache."""
    out = model(input_ids=ids, use_cache=True)
    logits, cache = [out.logits], output_cache(out)
    for t in _decode_tokens(ids.shape[0], steps):
        out = model(input_ids=t, **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits)
        cache = output_cache(out)
    return logits


@torch.no_grad()
def _paged_steps(rt: QuantizedKVRuntime, ids: torch.Tensor, steps: int):
    logits = [rt.forward(ids, new_sequence=True)]
    for t in _decode_tokens(ids.shape[0], steps):
        logits.append(rt.forward(t))
    return logits


def _decode_tokens(b: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (b, 1), generator=g) for _ in range(steps)]


# -- a reference: plain HF attention on fake-quantized Q/K/V ---------------------------
_REF_STATE: dict = {}


def _fake_quant_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    st = _REF_STATE
    layer = module.layer_idx
    if st["scales"] is None:
        # Dynamic: the prompt's per-head absmax, fixed at prefill (L == S).
        if key.shape[2] == query.shape[2]:
            amax_k = key.float().abs().amax(dim=(0, 2, 3))
            amax_v = value.float().abs().amax(dim=(0, 2, 3))
            amax_q = query.float().abs().amax(dim=(0, 2, 3))
            st["dyn"][layer] = {
                "k": torch.clamp(amax_k / 127, min=2**-23),
                "v": torch.clamp(amax_v / 127, min=2**-23),
                "q": torch.clamp(amax_q / 127, min=2**-23),
            }
        sc = st["dyn"][layer]
    else:
        sc = st["scales"][layer]

    def fq(x, s):
        return dequantize_per_head(
            quantize_per_head(x, s, axis=1), s, axis=1, dtype=x.dtype
        )

    key, value = fq(key, sc["k"]), fq(value, sc["v"])
    if st["mode"] == "faquant":
        query = fq(query, sc["q"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("test_fake_quant_kv", _fake_quant_attention)


@torch.no_grad()
def _reference_steps(model, ids, steps, mode, scales):
    """``scales``: per layer ``{"q","k","v"}`` or None (dynamic)."""
    _REF_STATE.update(mode=mode, scales=scales, dyn={})
    cfg = model.config
    old = cfg._attn_implementation
    # Same mask builder as sdpa so the reference is a plain sdpa model.
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register("test_fake_quant_kv", sdpa_mask)
    cfg._attn_implementation = "test_fake_quant_kv"
    try:
        return _plain_steps(model, ids, steps)
    finally:
        cfg._attn_implementation = old


def _assert_steps_close(got, want, atol):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a - b).abs().max().item()
        assert err <= atol, f"step {i}: max |diff| {err:.3g} > {atol}"


# -- float plumbing -------------------------------------------------------------------
@pytest.mark.parametrize("layout_bs", [16, 128])
def test_float_mode_matches_plain_model(model, layout_bs):
    ids = _ids(2, 37)
    want = _plain_steps(model, ids, 6)
    with enable_paged_int8_attention(model, mode="float", block_size=layout_bs) as rt:
        got = _paged_steps(rt, ids, 6)
        assert rt.cache.seq_len(rt._seq_ids[0]) == 37 + 6
    _assert_steps_close(got, want, FLOAT_ATOL)
    # The paged path is really used: float logits differ from the plain ones in the
    # last bits somewhere (identical tensors would mean nothing was rerouted).
    assert any(not torch.equal(a, b) for a, b in zip(got, want))


def test_float_mode_through_hf_generate(model):
    """Direct model(...) calls with HF's cache continue the paged sequences."""
    ids = _ids(1, 20)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    with enable_paged_int8_attention(model, mode="float", block_size=16) as rt:
        with torch.no_grad():
            got = model(input_ids=ids).logits  # empty HF cache: a new prefill
            out = model.generate(
                ids,
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert rt.cache.seq_len(rt._seq_ids[0]) == 20 + 7
        gen = rt.generate(ids, 8)
    assert (got - want).abs().max().item() <= FLOAT_ATOL
    assert torch.equal(out, gen)


# -- int8 modes against the fake-quant reference --------------------------------------
@pytest.mark.parametrize("mode", ["int8_kv", "faquant"])
def test_int8_dynamic_matches_fake_quant_reference(model, mode):
    ids = _ids(2, 29)
    with enable_paged_int8_attention(model, mode=mode, block_size=32) as rt:
        got = _paged_steps(rt, ids, 5)
        scales = [rt.layer_scales(i) for i in range(2)]
    want = _reference_steps(model, ids, 5, mode, None)
    _assert_steps_close(got, want, INT8_ATOL)
    for layer, sc in enumerate(scales):
        for n in ("k", "v") + (("q",) if mode == "faquant" else ()):
            # Layer 0 sees identical K/V; later layers inherit fp32 summation-order
            # noise from the layers before, so their absmax may move by an ulp.
            tol = 0.0 if layer == 0 else 1e-5
            torch.testing.assert_close(
                sc[n], _REF_STATE["dyn"][layer][n], rtol=tol, atol=0
            )
    # Quantization is not a no-op here: the float model differs by far more.
    plain = _plain_steps(model, ids, 5)
    assert max((a - b).abs().max().item() for a, b in zip(got, plain)) > 50 * INT8_ATOL


def _static_map(model, shrink: float = 0.7):
    """Scales from another input's dynamic run, shrunk so some values saturate."""
    with enable_paged_int8_attention(model, mode="faquant", block_size=32) as rt:
        rt.forward(_ids(1, 23, seed=5), new_sequence=True)
        per_layer = [
            {n: t * shrink for n, t in rt.layer_scales(i).items()} for i in range(2)
        ]
        names = list(rt.layer_names)
    smap = {
        name: {
            f"fa_{n}": (t, torch.zeros(t.shape, dtype=torch.int8))
            for n, t in sc.items()
        }
        for name, sc in zip(names, per_layer)
    }
    return smap, per_layer


@pytest.mark.parametrize("mode", ["int8_kv", "faquant"])
def test_int8_static_matches_fake_quant_reference(model, mode):
    smap, per_layer = _static_map(model)
    ids = _ids(1, 41)
    with enable_paged_int8_attention(model, mode=mode, scales=smap) as rt:
        got = _paged_steps(rt, ids, 5)
        assert rt.static
        torch.testing.assert_close(rt.layer_scales(1)["k"], per_layer[1]["k"])
    want = _reference_steps(model, ids, 5, mode, per_layer)
    _assert_steps_close(got, want, INT8_ATOL)


def test_artifact_directory_equals_scale_map(tmp_path):
    model = _tiny("llama")
    smap, _ = _static_map(model)
    tensors = {}
    for attn, entry in smap.items():
        for branch, (scale, offset) in entry.items():
            # On disk: [H, 1] scales (the Ascend layout), int8 zero offsets.
            tensors[f"{attn}.{branch}.scale"] = scale.view(-1, 1).contiguous()
            tensors[f"{attn}.{branch}.offset"] = offset.view(-1, 1).contiguous()
    save_file(tensors, str(tmp_path / "quant_model_weights.safetensors"))
    ids = _ids(1, 19)
    with enable_paged_int8_attention(model, mode="faquant", scales=smap) as rt:
        from_map = _paged_steps(rt, ids, 3)
    with enable_paged_int8_attention(model, mode="faquant", scales=tmp_path) as rt:
        from_dir = _paged_steps(rt, ids, 3)
    for a, b in zip(from_map, from_dir):
        assert torch.equal(a, b)


def test_generate_greedy_equals_stepwise_argmax():
    """Each generated token is the argmax of the logits of the step before it,
    recomputed with teacher forcing through :meth:`forward`."""
    model = _tiny("qwen2")
    ids = _ids(2, 12)
    with enable_paged_int8_attention(model, mode="int8_kv", block_size=32) as rt:
        out = rt.generate(ids, 6)
        step = rt.forward(ids, new_sequence=True)
        for i in range(6):
            assert torch.equal(step[:, -1].argmax(-1), out[:, 12 + i])
            if i < 5:
                step = rt.forward(out[:, 12 + i : 13 + i])
        assert step.shape == (2, 1, VOCAB)
    assert out.shape == (2, 18)
    assert torch.equal(out[:, :12], ids)


def test_generate_stops_at_eos():
    model = _tiny("llama")
    ids = _ids(1, 9)
    with enable_paged_int8_attention(model, mode="int8_kv", block_size=32) as rt:
        free = rt.generate(ids, 5)
        eos = int(free[0, 10])
        stopped = rt.generate(ids, 5, eos_token_id=eos)
        assert torch.equal(rt.generate(ids, 0), ids)
    assert stopped.shape[1] == 11
    assert torch.equal(stopped, free[:, :11])


def test_cache_growth_equals_fixed_cache():
    model = _tiny("llama")
    ids = _ids(2, 40)
    with enable_paged_int8_attention(model, mode="int8_kv", block_size=32) as rt:
        rt.forward(ids, new_sequence=True)
        assert rt.cache.num_blocks == 4  # 2 sequences x 2 blocks of 32
        grown = _paged_steps(rt, ids, 26)  # 66 tokens: 3 blocks each, regrown
        assert rt.cache.num_blocks == 8
    with enable_paged_int8_attention(
        model, mode="int8_kv", block_size=32, num_blocks=8
    ) as rt:
        fixed = _paged_steps(rt, ids, 26)
        assert rt.cache.num_blocks == 8
    for a, b in zip(grown, fixed):
        assert torch.equal(a, b)


def test_perplexity_float_paged_equals_plain():
    model = _tiny("llama")
    windows = [_ids(1, 33, seed=s)[0] for s in range(3)]
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(input_ids=w[None]).logits[0, :-1], -1)
            total -= float(logp.gather(-1, w[1:, None]).sum())
            count += w.numel() - 1
    want = torch.tensor(total / count).exp().item()
    with enable_paged_int8_attention(model, mode="float") as rt:
        got = rt.perplexity(windows)
    with enable_paged_int8_attention(model, mode="int8_kv") as rt:
        got_int8 = rt.perplexity(torch.stack(windows))
    assert abs(got - want) <= 1e-5 * want
    assert got_int8 != got and abs(got_int8 / want - 1) < 0.5


def test_dynamic_scales_helper():
    x = torch.randn(2, 3, 5, 8)
    x[1, 2, 4, 7] = -9.0
    got = dynamic_scales(x)
    want = torch.stack([x[:, h].abs().max() for h in range(3)]) / 127
    assert torch.equal(got, want.float())
    assert dynamic_scales(torch.zeros(1, 2, 3, 4)).tolist() == [2**-23] * 2


# -- removal and coexistence ----------------------------------------------------------
def test_remove_restores_model_exactly(model):
    ids = _ids(2, 17)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    impl = model.config._attn_implementation
    pre, post = len(model._forward_pre_hooks), len(model._forward_hooks)
    rt = enable_paged_int8_attention(model, mode="int8_kv")
    assert model.config._attn_implementation == PAGED_ATTENTION_IMPL
    with torch.no_grad():
        during = model(input_ids=ids).logits
    assert not torch.equal(during, before)
    with pytest.raises(ValueError, match="already enabled"):
        enable_paged_int8_attention(model)
    rt.remove()
    rt.remove()  # harmless
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(after, before)
    assert model.config._attn_implementation == impl
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == (pre, post)
    assert not any("_ascend_fa" in k for m in model.modules() for k in m.__dict__)
    with pytest.raises(RuntimeError, match="removed"):
        rt.forward(ids)
    # Enabling again works after removal.
    with enable_paged_int8_attention(model, mode="float") as rt2:
        assert rt2.cache is None


def test_coexists_with_fa3_placeholder_injection():
    from ascend_fa.adapters.gqa import GQAAdapter

    model = _tiny("llama")
    adapter = GQAAdapter()
    adapter.inject_fa3_placeholders("", model, lambda _n: True)
    wrapped = model.config._attn_implementation
    ids = _ids(1, 15)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    with enable_paged_int8_attention(model, mode="float") as rt:
        got = rt.forward(ids, new_sequence=True)
    assert (got - want).abs().max().item() <= FLOAT_ATOL
    assert model.config._attn_implementation == wrapped
    adapter.remove_fa3_placeholders(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


# -- bad inputs -----------------------------------------------------------------------
def test_rejects_unsupported_model_type():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64))
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        enable_paged_int8_attention(gpt2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "int4"}, "mode must be one of"),
        ({"block_size": 48}, "multiple of 32"),
        ({"mode": "float", "block_size": 8}, "multiple of 16"),
        ({"block_size": 0}, "positive multiple"),
        ({"block_size": 32.0}, "block_size must be an int"),
        ({"num_blocks": 0}, "num_blocks must be None or a positive int"),
        ({"mode": "float", "scales": {}}, "takes no scales"),
        ({"scales": 3}, "scales must be None, an artifact directory or a mapping"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    model = _tiny("llama")
    with pytest.raises(ValueError, match=match):
        enable_paged_int8_attention(model, **kwargs)
    assert model.config._attn_implementation != PAGED_ATTENTION_IMPL


def test_rejects_head_width_the_nz_cache_cannot_hold():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = LlamaForCausalLM(cfg).eval()
    with pytest.raises(
        ValueError,
        match=r"Hkv\*D = 2\*8 = 16 is not a multiple "
        r"of C0 = 32",
    ):
        enable_paged_int8_attention(model, mode="int8_kv")
    enable_paged_int8_attention(model, mode="float", block_size=16).remove()


def test_rejects_bad_scale_maps(tmp_path):
    model = _tiny("llama")
    smap, _ = _static_map(model)
    name = "model.layers.1.self_attn"
    bad = {k: dict(v) for k, v in smap.items()}
    bad[name]["fa_k"] = torch.ones(3)
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.self_attn\.fa_k\.scale has 3 "
        r"heads, the model has 2",
    ):
        enable_paged_int8_attention(model, scales=bad)
    bad = {k: dict(v) for k, v in smap.items()}
    del bad[name]["fa_q"]
    with pytest.raises(ValueError, match=r"fa_q is missing \(mode 'faquant'"):
        enable_paged_int8_attention(model, mode="faquant", scales=bad)
    enable_paged_int8_attention(model, mode="int8_kv", scales=bad).remove()
    bad = {k: v for k, v in smap.items() if k != name}
    with pytest.raises(
        ValueError, match="no entry for attention module 'model.layers.1.self_attn'"
    ):
        enable_paged_int8_attention(model, scales=bad)
    bad = {k: dict(v) for k, v in smap.items()}
    bad[name]["fa_v"] = (smap[name]["fa_v"][0], torch.ones(2, dtype=torch.int8))
    with pytest.raises(ValueError, match="offset is non-zero"):
        enable_paged_int8_attention(model, scales=bad)
    bad = {k: dict(v) for k, v in smap.items()}
    bad[name]["fa_v"] = -smap[name]["fa_v"][0]
    with pytest.raises(ValueError, match="must be finite and > 0"):
        enable_paged_int8_attention(model, scales=bad)
    with pytest.raises(FileNotFoundError, match="artifact directory not found"):
        enable_paged_int8_attention(model, scales=tmp_path / "missing")
    # An artifact whose head count does not match the model.
    tensors = {}
    for attn in smap:
        for branch, heads in (("fa_q", 4), ("fa_k", 1), ("fa_v", 2)):
            tensors[f"{attn}.{branch}.scale"] = torch.full((heads, 1), 0.1)
            tensors[f"{attn}.{branch}.offset"] = torch.zeros(heads, 1, dtype=torch.int8)
    save_file(tensors, str(tmp_path / "quant_model_weights.safetensors"))
    (tmp_path / "quant_model_description.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match=r"fa_k\.scale has 1 heads, the model has 2"):
        enable_paged_int8_attention(model, scales=tmp_path)
    assert model.config._attn_implementation != PAGED_ATTENTION_IMPL


def test_rejects_bad_steps():
    model = _tiny("llama")
    ids = _ids(2, 40)
    with enable_paged_int8_attention(model, block_size=32, num_blocks=3) as rt:
        with pytest.raises(ValueError, match="out of cache blocks"):
            rt.forward(ids, new_sequence=True)
        rt.forward(ids[:, :20], new_sequence=True)
        with pytest.raises(ValueError, match="2 sequences are held"):
            rt.forward(ids[:1, :1])
        with pytest.raises(ValueError, match="padded batches are not supported"):
            with torch.no_grad():
                mask = torch.ones(2, 40, dtype=torch.long)
                mask[0, 0] = 0
                model(input_ids=ids, attention_mask=mask)
        with pytest.raises(ValueError, match="input_ids must be"):
            rt.forward(torch.zeros(2, 0, dtype=torch.long))
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
            rt.generate(ids, -1)
        with pytest.raises(ValueError, match="every window needs >= 2 tokens"):
            rt.perplexity([ids[0, :1]])


def test_rejects_sliding_window_overflow():
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with enable_paged_int8_attention(model, block_size=32) as rt:
        rt.forward(_ids(1, 16), new_sequence=True)
        with pytest.raises(ValueError, match="exceed the model's sliding_window 16"):
            rt.forward(_ids(1, 17), new_sequence=True)


# -- the real model -------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_int8_kv_greedy_matches_float():
    from ascend_fa.emulation.verb import DEFAULT_PROMPT, compare, greedy_plain
    from ascend_fa.models import ModelNotFoundError, load_model

    try:
        loaded = load_model()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    model, tok = loaded.model, loaded.tokenizer
    ids = tok(DEFAULT_PROMPT, return_tensors="pt")["input_ids"]
    ref = greedy_plain(model, ids, 32)[0]
    with enable_paged_int8_attention(model, mode="int8_kv") as rt:
        got = rt.generate(ids, 32)[0]
    result = compare(ref, got, ids.shape[1])
    # Measured: 32/32 (identical greedy text) with dynamic int8-KV scales on this
    # prompt. 29 (90%) leaves room for one late near-tie flip on another BLAS while
    # still failing on any real cache or scale bug (which diverges within a few
    # tokens, as a wrong slot or scale garbles the context).
    assert result["matched"] >= 29, result


# -- the CLI --------------------------------------------------------------------------
def _tiny_checkpoint(path: Path) -> list[str]:
    """A tiny llama checkpoint with a word-level tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = (
        "the a keeper light house sea night storm ship rock lamp she he "
        "was went to and of in on at by it"
    ).split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", pad_token="[UNK]", eos_token="[UNK]"
    )
    fast.save_pretrained(path)
    _tiny("llama").save_pretrained(path)
    return words


def test_cli_emulate_reports_all_modes(tmp_path, capsys):
    from ascend_fa.cli import main

    words = _tiny_checkpoint(tmp_path / "model")
    g = torch.Generator().manual_seed(3)
    text = " ".join(
        words[int(i)] for i in torch.randint(0, len(words), (80,), generator=g)
    )
    (tmp_path / "eval.txt").write_text(text)
    out = tmp_path / "result.json"
    rc = main(
        [
            "emulate",
            "--model",
            str(tmp_path / "model"),
            "--prompt",
            "the keeper went to the light house at night",
            "--max-new-tokens",
            "6",
            "--eval-data",
            str(tmp_path / "eval.txt"),
            "--window",
            "32",
            "--block-size",
            "32",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "greedy match" in printed and "faquant" in printed
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["float (plain model)", "float-paged", "int8_kv", "faquant"]
    plain = rows["float (plain model)"]["ppl"]
    assert rows["float-paged"]["matched"] == rows["float-paged"]["prefix"] == 6
    assert abs(rows["float-paged"]["ppl"] / plain - 1) < 1e-5
    for mode in ("int8_kv", "faquant"):
        assert rows[mode]["n"] == 6 and 0 <= rows[mode]["matched"] <= 6
        assert rows[mode]["ppl"] != rows["float-paged"]["ppl"]
    # Teacher-forced fidelity: the plain model agrees with itself exactly, the
    # float paged cache reproduces it, the int8 paths are close but not equal.
    assert rows["float (plain model)"]["kl"] == 0.0
    assert rows["float (plain model)"]["top1"] == 1.0
    # KL per position is clamped at 0, so rounding leaves a tiny positive mean
    assert rows["float-paged"]["kl"] < 1e-6 and rows["float-paged"]["top1"] == 1.0
    for mode in ("int8_kv", "faquant"):
        assert 0 < rows[mode]["kl"] < 0.05 and 0.8 <= rows[mode]["top1"] <= 1.0
    assert "top-1" in printed and "KL" in printed


def test_fidelity_matches_direct_kl():
    """``fidelity`` is the mean over tokens of KL(ref || q) and of argmax agreement."""
    from ascend_fa.emulation.verb import fidelity

    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, 7, (5,), generator=g), torch.randint(0, 7, (3,))]
    ref = [torch.randn(1, w.numel(), 7, generator=g) for w in windows]
    q = [r + 0.3 * torch.randn(r.shape, generator=g) for r in ref]
    got = fidelity(q, ref, windows)
    kls, same = [], []
    for r, x in zip(ref, q, strict=True):
        p = torch.softmax(r.double(), -1)
        kls += (p * (p.log() - torch.log_softmax(x.double(), -1))).sum(-1)[0].tolist()
        same += (r.argmax(-1) == x.argmax(-1))[0].tolist()
    assert abs(got["kl"] - sum(kls) / len(kls)) < 1e-6
    assert got["top1"] == sum(same) / len(same)


def test_greedy_plain_stops_at_end_of_turn():
    """With ``eos_token_id`` greedy decoding stops once every row produced it, as the
    paged runtime does; without it, it runs the full length."""
    from ascend_fa.emulation.verb import greedy_plain

    model = _tiny("llama")
    ids = _ids(1, 9)
    full = greedy_plain(model, ids, 12)[0]
    eos = int(full[9 + 3])  # the fourth generated token
    short = greedy_plain(model, ids, 12, eos_token_id=eos)[0]
    first = (full[9:] == eos).nonzero()[0, 0].item()
    assert short.numel() == 9 + first + 1 and int(short[-1]) == eos
    assert torch.equal(short, full[: short.numel()])
    with enable_paged_int8_attention(model, mode="float") as rt:
        paged = rt.generate(ids, 12, eos_token_id=eos)[0]
    assert torch.equal(paged, short)


def test_cli_emulate_bad_arguments(tmp_path, capsys):
    from ascend_fa.cli import main

    assert main(["emulate", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be > 0" in capsys.readouterr().err
    assert main(["emulate", "--artifact", str(tmp_path / "nope")]) == 2
    assert "artifact not found" in capsys.readouterr().err


def test_inner_decoder_calls_are_separate_steps():
    """Calling the decoder (not the root LM) bypasses the root hooks; each call must
    still be its own step (prefill, then continuation through HF's cache)."""
    model = _tiny("llama")
    ids = _ids(1, 21)
    with torch.no_grad():
        want = model.model(input_ids=ids).last_hidden_state
        with enable_paged_int8_attention(model, mode="float", block_size=16) as rt:
            first = model.model(input_ids=ids).last_hidden_state
            again = model.model(input_ids=ids).last_hidden_state
            assert rt.cache.seq_len(rt._seq_ids[0]) == 21
    assert (first - want).abs().max().item() <= FLOAT_ATOL
    assert torch.equal(first, again)
