"""Qwen3-Next (``qwen3_next``): a hybrid of Gated DeltaNet linear-attention layers
and gated softmax-attention layers, MoE MLPs.

A tiny random checkpoint (4 layers: ``layer_types`` linear, linear, linear, full;
head_dim 32 with partial RoPE over the first 8 channels; 8 routed experts and a
gated shared expert) goes through ``calibrate`` for every target (MindIE 3.0.0 has
no model for it: a research run), ``inspect`` and ``eval``. Checked against
independent references: the observed Q (q_proj's query half, q_norm, RoPE over the
rotary channels; the output gate stays out), K's C8 ranges (pair norms over the
rotary channels only, plain |k| past them, from a naive loop), the smoothing folded
into a zero-centred ``1 + w`` norm (the norm's output divided by the factor), and
FA / C8 / FP8 scales on the full-attention layers only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from builders import byte_tokenizer, tiny_causal_lm
from safetensors import safe_open

from ascend_fa.adapters import get_adapter, injected_points
from ascend_fa.adapters.hf import swapped_points
from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact
from ascend_fa.calibration.job import default_recipe_path
from ascend_fa.calibration.kv import KVCalibration
from ascend_fa.calibration.pipeline import calibrate_model
from ascend_fa.calibration.recipe import load_recipe
from ascend_fa.cli import main
from ascend_fa.families import GQA_HYBRID, attention_kind
from ascend_fa.hf_compat import rotary_dim
from ascend_fa.linear import linear_plan
from ascend_fa.linear.engine import capture_layer_inputs
from ascend_fa.linear.norms import fold_into_norm, norm_weight_offset
from ascend_fa.linear.typed_inputs import TYPED_KWARGS, layer_kwargs

NEXT = dict(
    vocab_size=260,
    max_position_embeddings=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
FULL = "model.layers.3.self_attn"  # the one full-attention layer
HEADS, KV_HEADS, D, R = 4, 2, 32, 8  # R = partial_rotary_factor 0.25 * D
ARGS = ["--num-samples", "4", "--max-length", "32", "--batch-size", "2"]
ARGS += ["--heldout", "1", "--no-report", "-q"]


def _model(seed: int = 0) -> torch.nn.Module:
    return tiny_causal_lm("qwen3_next", seed=seed, attn="sdpa", **NEXT)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_next") / "src"
    model = tiny_causal_lm("qwen3_next", attn=None, **NEXT).to(torch.bfloat16)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


#: static W8A8 linears next to C8 where a consumer loads them (MindIE 3.0.0 has no
#: Qwen3-Next model; vllm-ascend's get_cache_scale_mapper maps its C8 from
#: 0.25.1rc1)
LINEARS = ["--target", "vllm-ascend", "--consumer-version", "main", "--linear", "w8a8"]


def _calibrate(src: Path, out: Path, *extra: str) -> int:
    return main(["calibrate", "--model", str(src), *ARGS, "--output", str(out), *extra])


def _names(out: Path) -> dict[str, list[int]]:
    shapes = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                shapes[k] = list(sf.get_slice(k).get_shape())
    return shapes


def _attn_with(names, suffix: str) -> set[str]:
    return {n[: -len(suffix)] for n in names if n.endswith(suffix)}


# -- family, adapter, plan ------------------------------------------------------


def test_family_and_adapter_cover_the_full_attention_layers_only():
    model = _model()
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert attention_kind("qwen3_next") is GQA_HYBRID
    adapter = get_adapter(model)
    assert [n for n, _ in adapter.attention_modules(model)] == [FULL]
    assert rotary_dim(model.config) == R


def test_observed_q_is_the_query_half_after_norm_and_partial_rope():
    """The FA points see Q ``[B, H, S, D]`` (the gate half of q_proj left out), K
    and V ``[B, Hkv, T, D]``; the logits are unchanged with the points in place."""
    model = _model()
    x = torch.randint(0, 250, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = model(x).logits
    attn = model.get_submodule(FULL)
    seen: dict[str, torch.Tensor] = {}

    def grab(_m, _args, kwargs):
        seen["h"], seen["pe"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    def make(_attn, branch, point):
        class Record(torch.nn.Module):
            def forward(self, t, token_mask=None):
                seen[branch] = t.detach().clone()
                return point(t, token_mask)

        return Record()

    hook = attn.register_forward_pre_hook(grab, with_kwargs=True)
    with injected_points(model) as (_adapter, mods), swapped_points(mods, make):
        assert list(mods) == [FULL]
        with torch.no_grad():
            logits = model(x).logits
    hook.remove()
    assert torch.equal(logits, ref)
    # Reference from the checkpoint's definition: q_proj rows per head are
    # [query D | gate D]; q_norm scales by (1 + w); RoPE rotate-half over [:R].
    with torch.no_grad():
        h, (cos, sin) = seen["h"], seen["pe"]
        q = attn.q_proj(h).view(2, 7, HEADS, 2 * D)[..., :D].double()
        w = attn.q_norm.weight.double()
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
        q = q.transpose(1, 2)
        c, s = cos.double()[:, None], sin.double()[:, None]
        rot, rest = q[..., :R], q[..., R:]
        half = torch.cat([-rot[..., R // 2 :], rot[..., : R // 2]], -1)
        q = torch.cat([rot * c + half * s, rest], -1)
    assert seen["fa_q"].shape == (2, HEADS, 7, D)
    assert seen["fa_k"].shape == seen["fa_v"].shape == (2, KV_HEADS, 7, D)
    assert torch.allclose(seen["fa_q"].double(), q, rtol=1e-5, atol=1e-5)


def test_plan_quantizes_attention_and_in_proj_qkvz_keeps_gates_float():
    plans = linear_plan(_model())
    full = {g.kind: g.linears for g in plans[3].groups}
    assert full["qkv"] == tuple(f"{FULL}.{p}_proj" for p in "qkv")
    assert full["o"] == (f"{FULL}.o_proj",)
    lin = plans[0].groups[0]
    assert lin.linears == ("model.layers.0.linear_attn.in_proj_qkvz",)
    assert lin.norm is None and lin.fold is None
    names = {n for p in plans for g in p.groups for n in g.linears}
    for i in range(3):
        a = f"model.layers.{i}.linear_attn"
        assert f"{a}.in_proj_ba" not in names and f"{a}.out_proj" not in names


def test_layer_by_layer_with_each_types_inputs_equals_the_model():
    """A padded batch run decoder layer by decoder layer from the captured inputs
    (each layer with its type's mask) gives the model's logits at real tokens."""
    model, tok = _model(), byte_tokenizer()
    batch = dict(tok(["a longer first sample, padded", "short"], padding=True,
                     return_tensors="pt"))  # fmt: skip
    ((hidden, kwargs, mask),) = capture_layer_inputs(model, None, [batch])
    assert set(kwargs[TYPED_KWARGS]) == {"linear_attention", "full_attention"}
    with torch.no_grad():
        for layer in model.model.layers:
            hidden = layer(hidden, **layer_kwargs(layer, kwargs))
        got = model.lm_head(model.model.norm(hidden))
        ref = model(**batch).logits
    assert torch.equal(got[mask], ref[mask])
    with pytest.raises(TypeError):  # a call that skips layer_kwargs fails loudly
        model.model.layers[3](hidden, **kwargs)


# -- zero-centred norms ---------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_next", "llama"])
def test_smoothing_fold_divides_the_norm_output_by_the_factor(model_type):
    """Qwen3-Next's norm scales by ``1 + w``, Llama's by ``w``: after the fold the
    output is the old output divided by ``s``."""
    if model_type == "qwen3_next":
        norm = _model().model.layers[0].input_layernorm
    else:
        llama = tiny_causal_lm("llama", hidden_size=64, num_hidden_layers=1,
                               num_attention_heads=4, vocab_size=260,
                               intermediate_size=64)  # fmt: skip
        norm = llama.model.layers[0].input_layernorm
    norm = norm.double()
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5 if model_type == "qwen3_next" else 2.0)
    assert norm_weight_offset(norm) == (1.0 if model_type == "qwen3_next" else 0.0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g, dtype=torch.float64)
    s = torch.rand(64, generator=g, dtype=torch.float64) * 4 + 0.1
    with torch.no_grad():
        before = norm(x)
        fold_into_norm(norm, s)
        after = norm(x)
    # Qwen3NextRMSNorm normalizes in float32 whatever the input dtype
    assert torch.allclose(after, before / s, rtol=1e-6, atol=1e-6)


def test_zero_centred_fold_returns_the_factor_the_rounded_weight_divides_out():
    """In bf16, ``(1 + w) / s - 1`` near -1 keeps 2**-8 of absolute precision:
    the returned factor is what the stored weight really divides out (so the
    columns times it keep the product exact), and no channel rounds to zero."""
    norm = _model().model.layers[0].input_layernorm.double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5, generator=g)
    old = norm.weight.detach().clone() + 1
    s = torch.rand(64, generator=g, dtype=torch.float64) * 4 + 0.5
    s[::4] = 3000.0  # (1 + w) / s far below bf16's step near -1
    with torch.no_grad():
        got = fold_into_norm(norm, s, "n", torch.bfloat16)
    w = norm.weight.detach()
    assert torch.equal(w, w.to(torch.bfloat16).double())  # stored as bf16 holds it
    assert ((w + 1) != 0).all()
    assert torch.allclose((w + 1) * got, old, rtol=1e-12, atol=0)
    assert not torch.allclose(got, s, rtol=1e-2)  # the rounding is not negligible
    # a plain norm divides in its own dtype and returns s itself
    plain = torch.nn.Module()
    plain.weight = torch.nn.Parameter(torch.rand(64, dtype=torch.float64) + 0.5)
    plain.forward = lambda x: x * plain.weight
    before = plain.weight.detach().clone()
    with torch.no_grad():
        assert fold_into_norm(plain, s, "p", torch.bfloat16) is s
    assert torch.equal(plain.weight.detach(), before / s)


def test_a_norm_of_another_form_is_refused():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * 3 * self.weight

    with pytest.raises(Exception, match="neither weight nor 1 \\+ weight"):
        fold_into_norm(Odd(), torch.full((8,), 2.0), "m.norm")


# -- C8 K ranges over the rotary channels ----------------------------------------


def test_c8_k_ranges_are_pair_norms_over_the_rotary_channels_only():
    """K's per-channel C8 range: the max of the RoPE pair's norm for the first R
    channels (pairs d, d + R/2), the max |k| for the unrotated rest; a naive loop
    over the recorded K. Pairing over the whole head gives other ranges."""
    model, recorded = _model(), []
    texts = [f"sample {i}: the quick brown fox" for i in range(4)]

    def run(cal):
        def wrap(attn, branch, point):
            inner = cal.wrap(attn, branch, point)
            if branch != "fa_k" or cal is not cals[0]:
                return inner

            class Record(torch.nn.Module):
                def forward(self, t, token_mask=None):
                    recorded.append(t.detach().double().clone())
                    return inner(t, token_mask)

            return Record()

        res = calibrate_model(model, byte_tokenizer(), texts,
                              recipe=load_recipe(default_recipe_path()),
                              max_length=16, batch_size=4, progress=False,
                              wrap=wrap)  # fmt: skip
        res.remove(model)

    cals = [KVCalibration("c8", rotary_dim=R), KVCalibration("c8")]
    for cal in cals:
        run(cal)
    assert set(cals[0].observers) == {FULL}
    k = torch.cat(recorded, 0)  # [B, Hkv, T, D], every token real (equal lengths)
    want = torch.zeros(KV_HEADS * D, dtype=torch.float64)
    for h in range(KV_HEADS):
        for d in range(D):
            best = 0.0
            for b in range(k.shape[0]):
                for t in range(k.shape[2]):
                    if d < R:
                        a, c = (
                            float(k[b, h, t, d % (R // 2)]),
                            float(k[b, h, t, d % (R // 2) + R // 2]),
                        )
                        best = max(best, math.sqrt(a * a + c * c))
                    else:
                        best = max(best, abs(float(k[b, h, t, d])))
            want[h * D + d] = best
    lo, hi = cals[0].observers[FULL]["k"].range()
    got = torch.maximum(-lo, hi).double()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    lo, hi = cals[1].observers[FULL]["k"].range()
    assert not torch.allclose(torch.maximum(-lo, hi).double(), want, rtol=1e-3)


# -- calibrate -> inspect -> eval per target --------------------------------------


def _eval(src: Path, out: Path) -> None:
    rc = main(["eval", "--model", str(src), "--artifact", str(out), "--window", "32",
               "--max-tokens", "96", "-q"])  # fmt: skip
    assert rc == 0


def test_mindie_default_linears_round_trip(src, tmp_path, capsys):
    """MindIE 3.0.0 has no Qwen3-Next model: a deployable run is refused in one
    line; the mindie layout is written by a research run (``--dtype fp32``), which
    ``inspect --target mindie`` refuses."""
    out = tmp_path / "mindie"
    assert _calibrate(src, out, "--target", "mindie") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "qwen3_next" in err and not out.exists()
    assert _calibrate(src, out, "--target", "mindie", "--dtype", "fp32") == 0
    assert main(["inspect", str(out), "--target", "mindie"]) == 1
    report = inspect_artifact(out, target="mindie")
    assert any("has no model for it" in f for f in report["findings"])
    names = _names(out)
    assert _attn_with(names, ".fa_q.scale") == {FULL}
    assert names[f"{FULL}.fa_q.scale"] == [HEADS, 1]
    assert names[f"{FULL}.fa_k.scale"] == [KV_HEADS, 1]
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["fa_quant_type"] == "FAQuant"
    for p in ("q", "k", "v", "o"):
        assert desc[f"{FULL}.{p}_proj.weight"] == "W8A8"
    for i in range(3):
        a = f"model.layers.{i}.linear_attn"
        assert desc[f"{a}.in_proj_qkvz.weight"] == "W8A8_DYNAMIC"
        for float_name in ("in_proj_ba.weight", "out_proj.weight", "conv1d.weight"):
            assert desc[f"{a}.{float_name}"] == "FLOAT"
        assert f"{a}.fa_q.scale" not in names
    capsys.readouterr()
    _eval(src, out)
    assert "artifact" in capsys.readouterr().out
    assert main(["inspect", str(out), "--target", "mindie"]) == 1
    printed = capsys.readouterr().out
    assert "[mindie.no-model]" in printed and "Qwen3NextForCausalLM" in printed


def test_mindie_default_quantizes_the_experts(src, tmp_path):
    """>= 90 % of the linear weight elements int8; every routed expert and the
    shared expert per token under the checkpoint's per-expert names, codes equal to
    a naive per-row quantizer; routers and shared_expert_gate float."""
    from builders import artifact_tensors, int8_fraction
    from test_family_moe import _naive

    out = tmp_path / "va"
    assert _calibrate(src, out, *LINEARS) == 0
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["model_quant_type"] == "W8A8"
    tensors, source = artifact_tensors(out), artifact_tensors(src)
    fraction = int8_fraction(src, out)
    assert fraction >= 0.9, fraction
    experts = [n for n in source if ".mlp.experts." in n]
    assert len(experts) == 4 * 8 * 3
    for name in experts:
        assert desc[name] == "W8A8_DYNAMIC", name
        codes, scales = _naive(source[name])
        prefix = name.removesuffix(".weight")
        assert torch.equal(tensors[name], codes), name
        assert torch.equal(tensors[f"{prefix}.weight_scale"].reshape(-1), scales)
    for i in range(4):
        m = f"model.layers.{i}.mlp"
        assert desc[f"{m}.gate.weight"] == desc[f"{m}.shared_expert_gate.weight"]
        assert desc[f"{m}.gate.weight"] == "FLOAT"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert desc[f"{m}.shared_expert.{proj}.weight"] == "W8A8_DYNAMIC"
    assert not [k for k in desc if "gate_up_proj" in k]


def test_vllm_fp8_scales_on_the_full_attention_layer_only(src, tmp_path):
    out = tmp_path / "vllm"
    assert _calibrate(src, out, "--target", "vllm") == 0
    assert main(["inspect", str(out), "--target", "vllm"]) == 0
    names = _names(out)
    assert _attn_with(names, ".k_scale") == {FULL}
    assert _attn_with(names, ".v_scale") == {FULL}
    _eval(src, out)


@pytest.mark.parametrize("release", ["0.13.0", "0.18.0", "0.23.0.post1"])
def test_vllm_ascend_c8_refused_by_releases_that_cannot_load_it(
    src, tmp_path, capsys, release
):
    out = tmp_path / "c8"
    rc = _calibrate(src, out, "--target", "vllm-ascend", "--consumer-version", release)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and not out.exists()
    assert "Qwen3NextForCausalLM" in err[0] and "0.25.1rc1" in err[0]


@pytest.mark.parametrize("release", ["0.25.1rc1", "main"])
def test_vllm_ascend_c8_round_trip(src, tmp_path, release):
    out = tmp_path / "c8"
    extra = ["--target", "vllm-ascend", "--consumer-version", release]
    assert _calibrate(src, out, *extra) == 0
    assert main(["inspect", str(out), "--target", "vllm-ascend",
                 "--consumer-version", release]) == 0  # fmt: skip
    names = _names(out)
    assert _attn_with(names, ".k_proj.kv_cache_scale") == {FULL}
    assert names[f"{FULL}.k_proj.kv_cache_scale"] == [KV_HEADS * D]
    assert not _attn_with(names, ".fa_q.scale")
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["kv_cache_type"] == "C8"
    _eval(src, out)


def test_streaming_is_bit_equal_to_the_whole_model(src, tmp_path):
    """Padded batches (samples of different lengths): each decoder layer run on
    its own gets its layer type's mask (the full-attention layer a causal one,
    the linear-attention layers the padding mask)."""
    data = tmp_path / "calib.jsonl"
    texts = [f"sample {i}: the quick brown fox" + " jumps" * (3 * i) for i in range(6)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    extra = [*LINEARS, "--calib-data", str(data)]
    one, two = tmp_path / "one", tmp_path / "two"
    assert _calibrate(src, one, *extra) == 0
    assert _calibrate(src, two, *extra, "--streaming") == 0
    for f in one.glob("*.safetensors"):
        with safe_open(str(f), "pt") as a, safe_open(str(two / f.name), "pt") as b:
            assert set(a.keys()) == set(b.keys())
            for k in a.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_emulate_and_transforms_are_refused_in_one_line(src, tmp_path, capsys):
    out = tmp_path / "x"
    assert _calibrate(src, out, *LINEARS, "--transforms", "v-rotation") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gated attention" in err[0] and not out.exists()
    rc = main(["emulate", "--model", str(src), "--max-new-tokens", "2", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "recurrent state" in err[0] and "linear_attention" in err[0]


@pytest.mark.slow
def test_two_data_parallel_ranks_equal_one_process(src, tmp_path):
    """Two gloo ranks (2 + 1 batches) write the artifact of one process."""
    import torch.multiprocessing as mp
    from test_data_parallel import TEXTS, _worker, assert_same_artifact

    from ascend_fa.calibration.job import calibrate

    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    kw = dict(num_samples=6, max_length=24, batch_size=2, heldout=2,
              target="vllm-ascend", consumer_version="main", linear="w8a8",
              picture_report=False, progress=False)  # fmt: skip
    one = calibrate(src, output=tmp_path / "one", calib_data=data, **kw)
    assert one.output.is_dir()
    args = (str(tmp_path / "store"), str(src), str(data), str(tmp_path / "two"), kw)
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    assert_same_artifact(one.output, tmp_path / "two", ranks=2)
