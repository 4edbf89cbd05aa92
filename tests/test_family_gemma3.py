"""Gemma 3 (``gemma3_text``): a GQA family with sliding-window and full layers, norms
that scale by ``1 + weight`` and sandwich norms around each block.

A tiny random Gemma 3 (4 layers: sliding, full, sliding, full; ``sliding_window``
8 so that 32-token calibration samples differ between the two types; random norm
weights so that ``1 + w`` is not 1) goes through every path: ``calibrate`` for
vllm, and the mindie layout (default W8A8 linears) as a research run (``--dtype
fp32``: MindIE 3.0.0 has no Gemma 3 model, a deployable mindie run is refused),
``inspect``, ``eval``, ``emulate``, ``--streaming``, and a data-parallel run (slow);
vllm-ascend C8 is refused on every release, naming it. Smoothing folded into the
``1 + w`` norms (and qk-smoothing into ``q_norm`` / ``k_norm``) leaves the float
model's logits unchanged within an fp32 budget, and the layer-sequential linear
calibration runs each layer with its own type's mask and RoPE table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from builders import byte_tokenizer, tiny_causal_lm  # noqa: E402
from safetensors import safe_open  # noqa: E402

from ascend_fa.adapters import GQAAdapter, get_adapter  # noqa: E402
from ascend_fa.artifact import DESCRIPTION_FILE, RELEASES, inspect_artifact  # noqa: E402
from ascend_fa.artifact.model_files import with_transformers4_rope  # noqa: E402
from ascend_fa.cli import main  # noqa: E402
from ascend_fa.emulation import enable_paged_int8_attention  # noqa: E402
from ascend_fa.errors import UnsupportedError  # noqa: E402
from ascend_fa.families import attention_kind  # noqa: E402
from ascend_fa.linear.engine import _apply_smoothing  # noqa: E402
from ascend_fa.linear.norms import fold_into_norm  # noqa: E402
from ascend_fa.linear.plan import linear_plan  # noqa: E402
from ascend_fa.linear.typed_inputs import (  # noqa: E402
    capture_layer_inputs,
    layer_kwargs,
)
from ascend_fa.transforms.attention import fold_qk_smoothing  # noqa: E402
from ascend_fa.transforms.residual import rotate_residual  # noqa: E402

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
WINDOW = 8
GEMMA = dict(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # Hkv * D = 32: whole int8 NZ fractals for the paged emulation
    query_pre_attn_scalar=24,  # the scale is 24**-0.5, not head_dim**-0.5
    layer_types=TYPES,
    sliding_window=WINDOW,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)
ATTN = [f"model.layers.{i}.self_attn" for i in range(4)]
CAL = ["--num-samples", "4", "--max-length", "32", "--batch-size", "2"]
CAL += ["--heldout", "1", "--no-report", "-q"]
#: MindIE has no Gemma 3 model: the mindie layout is written by a research run
RESEARCH = [*CAL, "--dtype", "fp32"]
#: fp32 budget of a smoothing fold: each folded weight and factor is rounded once to
#: fp32 (relative 2**-24) and the 4-layer forward re-associates nothing else.
FOLD_RTOL = 1e-5


def tiny_gemma(seed: int = 0, attn: str | None = "sdpa") -> torch.nn.Module:
    """The tiny Gemma 3 with every RMSNorm weight random (N(0, 0.3)): transformers
    initializes them to 0, where ``1 + w`` and ``w`` folds would look alike."""
    model = tiny_causal_lm("gemma3_text", seed=seed, attn=attn, **GEMMA)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma3") / "src"
    tiny_gemma(attn=None).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mindie(src, tmp_path_factory) -> Path:
    """The mindie layout as a research run (``--dtype fp32``): MindIE 3.0.0 has no
    Gemma 3 model, so a deployable ``--target mindie`` run is refused."""
    out = tmp_path_factory.mktemp("gemma3_mindie") / "out"
    args = ["calibrate", "--model", str(src), *RESEARCH, "--output", str(out)]
    assert main(args) == 0
    return out


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


# -- family data ---------------------------------------------------------------


def test_family_is_gqa_with_its_own_plan_and_no_residual_rotation():
    model = tiny_gemma()
    kind = attention_kind("gemma3_text")
    assert kind.fa_quant_type == "FAQuant" and kind.norm_offset == 1.0
    assert isinstance(get_adapter(model), GQAAdapter)
    plans = linear_plan(model)
    assert len(plans) == 4
    for i, plan in enumerate(plans):
        norms = {g.kind: g.norm for g in plan.groups}
        p = f"model.layers.{i}"
        assert norms == {
            "qkv": f"{p}.input_layernorm",
            "o": None,
            "gate_up": f"{p}.pre_feedforward_layernorm",  # not the post-attn norm
            "down": None,
        }
    with pytest.raises(UnsupportedError, match="post_attention_layernorm") as err:
        rotate_residual(model)
    assert "\n" not in str(err.value)


# -- smoothing folds into (1 + w) norms ------------------------------------------


@torch.no_grad()
def test_offset_norm_fold_against_a_naive_rounding():
    """:func:`fold_into_norm` into a Gemma (1 + w) norm stored in bf16: the stored
    weight is ``bf16(m / s - 1)`` (rounded once, from float64), a multiplier that
    would round to zero keeps half a step above ``-1``, and ``(1 + stored) *
    s_eff`` is the unsmoothed multiplier."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(5)
    w = 0.3 * torch.randn(256, generator=g)
    s = torch.exp(3 * torch.randn(256, generator=g))  # up to ~e^9: some underflow
    s[:4] = torch.tensor([1e4, 3e3, 1.0, 0.01])
    m = w.double() + 1
    norm = Gemma3RMSNorm(256)
    norm.weight.data.copy_(w)
    s_eff = fold_into_norm(norm, s, "norm", torch.bfloat16)
    stored = norm.weight.data
    naive = (m / s.double() - 1).to(torch.bfloat16).float()
    lost = naive == -1
    assert bool(lost[:2].all()) and not bool(lost[2:4].any())
    eps = torch.finfo(torch.bfloat16).eps
    assert torch.equal(stored[~lost], naive[~lost])
    assert torch.equal(stored[lost], torch.full_like(stored[lost], -1 + eps / 2))
    assert torch.equal(stored, stored.to(torch.bfloat16).float())
    back = (stored.double() + 1) * s_eff.double()
    assert float(((back - m) / m).abs().max()) <= 2**-23


@torch.no_grad()
def test_norm_folds_keep_the_float_model_within_fp32():
    """Every smoothable group of every layer folded with random factors (norms
    stored in bf16 as ``(1 + w) / s - 1``, ``v_proj`` / ``up_proj`` rows; ``o``'s
    tied over the query heads of a KV head), and qk-smoothing into ``q_norm`` /
    ``k_norm``: the float logits stay within :data:`FOLD_RTOL` of the unsmoothed
    model's. Folding as a plain ``w / s`` would not, nor would the bf16 norm
    weights with the columns times ``s`` instead of ``s_eff``."""
    ids = _ids(24)
    model = tiny_gemma()
    ref = model(ids).logits

    def fold(net: torch.nn.Module, dtype: torch.dtype | None) -> None:
        g = torch.Generator().manual_seed(7)
        for plan in linear_plan(net):
            for group in plan.groups:
                k = net.get_submodule(group.linears[0]).in_features
                s = torch.exp(2 * torch.randn(k // group.tie, generator=g))
                if group.tie > 1:  # o: one factor per KV head's channel, as searched
                    s = s.view(-1, 1, group.head_dim).expand(-1, group.tie, -1)
                _apply_smoothing(net, group, s.reshape(k), dtype)

    fold(model, torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    for name in ATTN:
        f = torch.exp(0.5 * torch.randn(1, GEMMA["head_dim"] // 2, generator=g))
        fold_qk_smoothing(model.get_submodule(name), f)
    got = model(ids).logits
    budget = FOLD_RTOL * ref.abs().max()
    torch.testing.assert_close(got, ref, rtol=FOLD_RTOL, atol=budget)

    plain = tiny_gemma()  # fp32 norm weights: the same fold without any rounding
    fold(plain, None)
    torch.testing.assert_close(plain(ids).logits, ref, rtol=FOLD_RTOL, atol=budget)
    for name, p in plain.named_parameters():  # then rounded, columns left as they are
        if name.endswith("layernorm.weight"):
            p.copy_(p.to(torch.bfloat16).float())
    assert (plain(ids).logits - ref).abs().max() > 100 * budget

    wrong = tiny_gemma()  # the plain fold (w / s) on Gemma's (1 + w) norm
    group = linear_plan(wrong)[0].groups[0]
    wrong.get_submodule(group.norm).weight.div_(2.0)
    for name in group.linears:
        wrong.get_submodule(name).weight.mul_(2.0)
    assert (wrong(ids).logits - ref).abs().max() > 100 * budget


# -- per-type layer inputs ---------------------------------------------------------


@torch.no_grad()
def test_each_layer_runs_with_its_types_mask_and_rope():
    """The captured inputs hold one mask and RoPE table per layer type; running the
    stack layer by layer with them gives the model's own hidden states bit for bit,
    while layer 0's (sliding) inputs would change the full layers."""
    model = tiny_gemma()
    ids = _ids(20)
    want = model(ids, output_hidden_states=True).hidden_states
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    layers = model.model.layers
    ((hidden, kwargs, mask),) = capture_layer_inputs(model, layers[0], [batch])
    assert all(a is b for a, b in zip(model.model.layers, layers, strict=True))
    assert bool(mask.all()) and torch.equal(hidden, want[0])
    for i, layer in enumerate(layers[:-1]):  # the last one's output is normed
        hidden = layer(hidden, **layer_kwargs(layer, kwargs))
        assert torch.equal(hidden, want[i + 1]), i
    first = layer_kwargs(layers[0], kwargs)
    assert not torch.equal(layers[1](want[1], **first), want[2])
    with pytest.raises(TypeError):  # skipping layer_kwargs: no mask, no RoPE
        layers[1](want[1], **kwargs)


# -- calibrate / inspect / eval / emulate -------------------------------------------


def test_mindie_refused_and_the_research_run_has_fa_on_every_layer(
    src, mindie, tmp_path, capsys
):
    out = tmp_path / "deploy"
    assert main(["calibrate", "--model", str(src), *CAL, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "gemma3_text" in err and not out.exists()
    result = inspect_artifact(mindie, target="mindie")
    # MindIE 3.0.0 has no Gemma 3 model: a finding with its citation
    assert any("has no model for it" in f for f in result["findings"])
    assert main(["inspect", str(mindie), "--target", "mindie"]) == 1
    desc = json.loads((mindie / DESCRIPTION_FILE).read_text())
    assert desc["fa_quant_type"] == "FAQuant" and desc["model_quant_type"] == "W8A8"
    fa = sorted({k.rsplit(".", 2)[0] for k in desc if ".fa_" in k})
    assert fa == ATTN  # sliding and full layers alike: all softmax attention
    assert all(desc[f"{a}.quant_type"] == "INT8" for a in ATTN)
    with safe_open(str(mindie / "quant_model_weights.safetensors"), "pt") as f:
        for a in ATTN:
            assert f.get_tensor(f"{a}.fa_q.scale").shape == (4, 1)
            assert f.get_tensor(f"{a}.fa_k.scale").shape == (2, 1)
        mlp = "model.layers.1.mlp"
        for lin in ("gate_proj", "up_proj", "down_proj"):
            assert f.get_tensor(f"{mlp}.{lin}.weight").dtype == torch.int8
        assert desc["lm_head.weight"] == "FLOAT"


def test_config_gains_the_transformers4_rope_keys(mindie):
    """A transformers-4 reader of the artifact's config.json gets Gemma 3's two
    RoPEs (``rope_theta``, ``rope_local_base_freq``); transformers 5 reads the same
    ``rope_parameters`` back."""
    cfg = json.loads((mindie / "config.json").read_text())
    assert cfg["rope_theta"] == 1e6 and cfg["rope_local_base_freq"] == 1e4
    assert "rope_scaling" not in cfg  # the default RoPE: nothing to scale
    back = transformers.AutoConfig.from_pretrained(mindie)
    assert back.rope_parameters == tiny_gemma().config.rope_parameters
    scaled = {
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        "rope_theta": 5e5,  # present: never changed
    }
    out = with_transformers4_rope(scaled)
    assert out["rope_scaling"] == {"factor": 8.0, "rope_type": "linear"}
    assert out["rope_theta"] == 5e5 and out["rope_local_base_freq"] == 1e4


def test_vllm_fp8_kv_on_every_layer_and_its_eval(src, tmp_path):
    out = tmp_path / "vllm"
    args = ["calibrate", "--model", str(src), *CAL, "--target", "vllm"]
    assert main([*args, "--output", str(out)]) == 0
    assert main(["inspect", str(out), "--target", "vllm"]) == 0
    with safe_open(str(out / "quant_model_weights.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"{a}.{s}_scale" for a in ATTN for s in "kv"} <= names
    report = tmp_path / "eval.json"
    args = ["eval", "--model", str(src), "--artifact", str(out), "-q"]
    args += ["--window", "16", "--max-tokens", "64", "--json", str(report)]
    assert main(args) == 0
    assert all(a in report.read_text() for a in ATTN)


@pytest.mark.parametrize("release", [r.name for r in RELEASES if r.target != "mindie"])
def test_vllm_ascend_c8_is_refused_naming_the_release(src, tmp_path, capsys, release):
    """No vllm-ascend release runs C8 for Gemma 3: 0.13 / 0.18 cannot parse the
    per-layer-type rope_parameters of this transformers-5 config.json
    (ValidationError, the real loader; with a published config.json 0.13 raises
    KeyError and 0.18 keeps one scale for every channel), 0.23 raises KeyError,
    0.25.1rc1 / main raise AttributeError in vLLM's QKVParallelLinear.load_weights
    (the real loader; by reading, their C8 attention would apply no sliding window
    either)."""
    out = tmp_path / "c8"
    args = ["calibrate", "--model", str(src), *CAL, "--target", "vllm-ascend"]
    assert main([*args, "--consumer-version", release, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"vllm-ascend {release} " in err
    assert "Gemma3ForCausalLM" in err and not out.exists()
    if release in ("0.25.1rc1", "main"):
        assert "[c8.gemma3-qkv-module]" in err and "AttributeError" in err
    if release in ("0.13.0", "0.18.0"):
        assert "[config.per-layer-type-rope]" in err and "ValidationError" in err


def test_eval_round_trip(src, mindie, tmp_path):
    report = tmp_path / "eval.json"
    args = ["eval", "--model", str(src), "--artifact", str(mindie), "-q"]
    assert (
        main([*args, "--window", "16", "--max-tokens", "64", "--json", str(report)])
        == 0
    )
    rows = json.loads(report.read_text())
    text = json.dumps(rows)
    assert all(a in text for a in ATTN)


def test_streaming_equals_the_whole_model(src, mindie, tmp_path):
    out = tmp_path / "stream"
    args = ["calibrate", "--model", str(src), *RESEARCH, "--streaming"]
    args += ["--output", str(out)]
    assert main(args) == 0
    name = "quant_model_weights.safetensors"
    with (
        safe_open(str(mindie / name), "pt") as a,
        safe_open(str(out / name), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


@torch.no_grad()
def test_paged_emulation_up_to_the_window_and_refused_past_it():
    """Up to ``sliding_window`` tokens a sliding layer attends every earlier token:
    the float paged cache reproduces the model (the same budget as the llama
    float-paged check); one token more is refused in one line."""
    model = tiny_gemma()
    ids = _ids(WINDOW)
    ref = model(ids).logits
    with enable_paged_int8_attention(model, mode="float", block_size=16) as rt:
        got = rt.forward(ids, new_sequence=True)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
        with pytest.raises(ValueError, match="sliding_window 8") as err:
            rt.forward(_ids(WINDOW + 1), new_sequence=True)
    msg = str(err.value)
    assert "\n" not in msg and "(2 of its 4 layers)" in msg and "at most 8" in msg
    with enable_paged_int8_attention(model, mode="faquant") as rt:
        rt.generate(ids[:, :4], max_new_tokens=4)  # 8 tokens: within the window


def test_paged_emulation_refuses_bidirectional_attention():
    model = tiny_gemma()
    model.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention") as err:
        enable_paged_int8_attention(model, mode="float")
    assert "\n" not in str(err.value)


def test_emulate_cli(src, mindie, capsys):
    args = ["emulate", "--model", str(src), "--artifact", str(mindie), "-q"]
    short = ["--prompt", "abc", "--max-new-tokens", "4", "--window", str(WINDOW)]
    assert main([*args, *short, "--max-eval-tokens", "64", "--block-size", "32"]) == 0
    capsys.readouterr()
    assert main([*args, "--block-size", "32"]) == 2  # the default 512-token window
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "sliding_window 8" in err


@pytest.mark.slow
def test_torchrun_equals_one_process(src, mindie, tmp_path):
    from test_data_parallel import _torchrun, assert_same_artifact

    # the reference ran with this process's threads; the split changes no bit
    many = tmp_path / "many"
    run = _torchrun(
        2, ["calibrate", "--model", str(src), *RESEARCH, "--output", str(many)]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data-parallel calibration: 2 ranks (gloo)" in run.stdout
    assert_same_artifact(mindie, many, 2)
