"""DeepSeek Sparse Attention families: ``deepseek_v32`` and ``glm_moe_dsa``.

MLA (the DeepSeek-V3 adapter's FA points on the absorbed query and the latent) plus
a lightning indexer whose top-k selection masks the attention; glm_moe_dsa's
"shared" layers reuse the previous layer's top-k. On tiny random checkpoints: the
FA points sit on every MLA layer and leave the logits bit-equal; the absorbed
fake-quant path reproduces the model with the indexer's mask; the indexer linears
stay float and take the smoothing of the groups whose input they read (the fold is
exact); the Ascend targets write the quantized linears only (their consumers' sparse
attention reads no FA scale: the rules of ``artifact.releases``), which ``inspect``
accepts and ``eval`` runs; what no consumer loads is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from builders import (
    artifact_tensors,
    byte_tokenizer,
    int8_fraction,
    plan_int8_fraction,
    tiny_causal_lm,
)

from ascend_fa.adapters import DeepseekV3Adapter, get_adapter
from ascend_fa.adapters.hf import set_point
from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact
from ascend_fa.artifact.releases import (
    RELEASES,
    check_release,
    release_findings,
    release_notes,
    release_scheme,
)
from ascend_fa.calibration import FA3FakeQuant, FA3QuantPlaceHolder
from ascend_fa.calibration.job import calibrate
from ascend_fa.cli import main
from ascend_fa.errors import UnsupportedError
from ascend_fa.families import MLA_DSA, attention_kind, is_mla
from ascend_fa.linear import linear_plan
from ascend_fa.linear.engine import _apply_smoothing

H, R = 4, 32
#: 3 layers, a dense first layer then MoE (8 routed experts, 1 shared), MLA with a
#: q LoRA, an indexer of 2 heads x 16 keeping 4 of the keys (so it masks)
DSA_TINY = dict(
    vocab_size=260,
    max_position_embeddings=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=H,
    num_key_value_heads=H,
    kv_lora_rank=R,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    index_topk=4,
    index_head_dim=16,
    index_n_heads=2,
)
EXTRA = {
    "deepseek_v32": {},
    "glm_moe_dsa": {"indexer_types": ["full", "shared", "full"]},
}
TYPES = tuple(EXTRA)
ARCH = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
TEXTS = [
    f"Sample {i}: the quick brown fox jumps over {i * 7} lazy dogs; print(x[{i}])"
    for i in range(8)
]
RUN = dict(num_samples=4, max_length=24, batch_size=2, heldout=2)


def tiny(model_type: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    return tiny_causal_lm(
        model_type, seed=seed, attn=attn, **DSA_TINY, **EXTRA[model_type]
    )


def save(tmp_path, model_type: str):
    path = tmp_path / model_type
    tiny(model_type, attn=None).to(torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def ids(b=2, s=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, s), generator=g)


def _data(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def _run(src, out, tmp_path, **kw):
    return calibrate(
        src,
        output=out,
        calib_data=_data(tmp_path),
        picture_report=False,
        progress=False,
        **{**RUN, **kw},
    )


def _desc(out):
    return json.loads((out / DESCRIPTION_FILE).read_text())


_tensors = artifact_tensors


# -- family data, adapter ------------------------------------------------------


@pytest.mark.parametrize("model_type", TYPES)
def test_family_is_mla_with_no_ascend_fa_target(model_type):
    kind = attention_kind(model_type)
    assert kind is MLA_DSA and is_mla(model_type)
    assert kind.adapter == "DeepseekV3Adapter" and kind.fa_targets == ()
    model = tiny(model_type)
    assert set(model.config.layer_types) == {"indexed_attention"}
    assert isinstance(get_adapter(model), DeepseekV3Adapter)


@torch.no_grad()
@pytest.mark.parametrize("model_type", TYPES)
def test_points_on_every_mla_layer_logits_bit_equal(model_type):
    """Every layer is MLA (glm's shared layers too, which have no indexer): the
    FA points sit on all three, observe [B, H, S, R] / [B, 1, S, R], and leave the
    logits bit-equal; removing them restores the model."""
    model = tiny(model_type)
    x = ids()
    ref = model(x).logits
    adapter = get_adapter(model)
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    mods = dict(adapter.attention_modules(model))
    assert sorted(mods) == [f"model.layers.{i}.self_attn" for i in range(3)]
    seen = {}

    def hook(key):
        def record(_m, args, _out):
            seen[key] = tuple(args[0].shape)

        return record

    for name, m in mods.items():
        assert isinstance(m.fa_q, FA3QuantPlaceHolder)
        for b in ("fa_q", "fa_k"):
            m.get_submodule(b).register_forward_hook(hook((name, b)))
    assert torch.equal(model(x).logits, ref)
    for name in mods:
        assert seen[(name, "fa_q")] == (2, H, 12, R)
        assert seen[(name, "fa_k")] == (2, 1, 12, R)
    adapter.remove_fa3_placeholders(model)
    assert torch.equal(model(x).logits, ref)


class _Copy(torch.nn.Module):
    """Returns a copy (so the absorbed path runs) and keeps each head's abs max."""

    def __init__(self) -> None:
        super().__init__()
        self.absmax: torch.Tensor | None = None

    def forward(self, x, token_mask=None):
        self.absmax = x.detach().abs().amax(dim=(0, 2, 3))
        return x.clone()


@torch.no_grad()
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", TYPES)
def test_absorbed_fake_quant_path_keeps_the_indexer_mask(model_type, attn):
    """Points returning a copy switch every layer to absorbed attention, computed
    with the mask the indexer made: the float logits within fp32 reassociation
    error (a dropped top-k mask moves them by far more); int8 fake-quant moves
    them by an int8 error."""
    model = tiny(model_type, attn)
    x = ids()
    ref = model(x).logits
    adapter = get_adapter(model)
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    mods = dict(adapter.attention_modules(model))
    copies = {}
    for name, m in mods.items():
        for b in ("fa_q", "fa_k", "fa_v"):
            copies[(name, b)] = _Copy()
            set_point(m, b, copies[(name, b)])
    out = model(x).logits
    assert not torch.equal(out, ref)  # the absorbed computation ran
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    unmasked = tiny(model_type, attn)
    unmasked.config.index_topk = 10**6  # every key selected: no sparse mask
    for layer in unmasked.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 10**6
    assert (unmasked(x).logits - ref).abs().max() > 1e-3
    for name, m in mods.items():
        for b in ("fa_q", "fa_k", "fa_v"):
            scale = copies[(name, b)].absmax / 127  # per head, no clipping
            set_point(m, b, FA3FakeQuant(b, scale))
    fq = model(x).logits
    assert not torch.allclose(fq, ref, atol=1e-4)
    # int8 rounding of the latent and the absorbed query (measured 2-6 %, MoE
    # routing included), not garbage (~100 %)
    assert float((fq - ref).norm() / ref.norm()) < 0.15


# -- linear plan -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", TYPES)
def test_plan_indexer_linears_are_float_readers(model_type):
    model = tiny(model_type)
    plans = linear_plan(model)
    planned = {n for p in plans for g in p.groups for n in g.linears}
    assert not [n for n in planned if ".indexer." in n or "kv_b_proj" in n]
    for p in plans:
        a = f"{p.prefix}.self_attn"
        groups = {g.kind: g for g in p.groups}
        has = model.get_submodule(a).indexer is not None
        assert groups["attn_in"].readers == (
            (f"{a}.indexer.wk", f"{a}.indexer.weights_proj") if has else ()
        )
        assert groups["q_b"].readers == ((f"{a}.indexer.wq_b",) if has else ())
        assert (p.experts is None) == (p.index == 0)
    if model_type == "glm_moe_dsa":
        assert plans[1].groups[0].readers == ()  # a shared layer: no indexer


def _smooth(model, readers: bool) -> None:
    """Random factors in [0.25, 4.25) folded into every attn_in / q_b group."""
    g = torch.Generator().manual_seed(3)
    for p in linear_plan(model):
        for group in p.groups:
            if group.kind in ("attn_in", "q_b"):
                k = model.get_submodule(group.linears[0]).in_features
                s = torch.rand(k, generator=g) * 4 + 0.25
                if not readers:
                    group = dataclasses.replace(group, readers=())
                _apply_smoothing(model, group, s)


@torch.no_grad()
@pytest.mark.parametrize("model_type", TYPES)
def test_smoothing_fold_is_exact_with_the_indexer(model_type):
    """Folding smoothing factors into input_layernorm / q_a_layernorm scales the
    indexer's readers too: its top-k, hence the logits, stay (fp32 rounding);
    without the readers the indexer scores scaled inputs and the logits move."""
    x = ids()
    ref = tiny(model_type, "eager")(x).logits
    model = tiny(model_type, "eager")
    _smooth(model, readers=True)
    torch.testing.assert_close(model(x).logits, ref, rtol=1e-4, atol=1e-4)
    bare = tiny(model_type, "eager")
    _smooth(bare, readers=False)
    assert (bare(x).logits - ref).abs().max() > 1e-2


# -- consumer rules ----------------------------------------------------------------


@pytest.mark.parametrize("model_type", TYPES)
def test_release_rules(model_type, caplog):
    """No release of either Ascend consumer reads FAKQuant for these (vllm-ascend:
    a finding everywhere; MindIE: DeepSeek-V3.2's FAKQuant is refused, its
    quantized linears load); MindIE 3.0.0 has no glm_moe_dsa model: the release
    table notes it, calibrate refuses it (ascend_fa.artifact.mindie_models)."""
    arch = ARCH[model_type]
    glm = model_type == "glm_moe_dsa"
    assert release_scheme("mindie", True, False) == "linears"
    for r in RELEASES:
        fak = release_findings(r.target, r, "FAKQuant", arch)
        lin = release_findings(r.target, r, "linears", arch)
        notes = release_notes(r.target, r, "linears", arch)
        if r.target == "vllm-ascend":
            assert fak and "fakquant.sfa" in fak[0] and "sfa_v1.py" in fak[0]
            assert not lin and not notes
        elif glm:
            assert "mindie.fakquant-dsa" in fak[0] and not lin
            assert "mindie.no-model" in notes[0]  # calibrate refuses it itself
        else:
            assert "mindie.fakquant-dsa" in fak[0] and not lin and not notes
    assert not release_findings(
        "vllm-ascend", RELEASES[2], "FAKQuant", "DeepseekV3ForCausalLM"
    )
    cfg = {"model_type": model_type, "kv_lora_rank": R}
    assert check_release("vllm-ascend", None, config=cfg) == "vllm-ascend"
    with caplog.at_level("WARNING"):
        assert check_release("mindie", None, config=cfg) == "mindie"
    assert ("mindie.no-model" in caplog.text) == glm


# -- calibrate -> inspect -> eval ------------------------------------------------


def _linears_only(out, model_type, quant_type):
    desc = _desc(out)
    assert desc["model_quant_type"] == quant_type
    assert "fa_quant_type" not in desc and "kv_cache_type" not in desc
    t = _tensors(out)
    assert not [n for n in t if ".fa_" in n]
    for i in range(3):
        a = f"model.layers.{i}.self_attn"
        assert t[f"{a}.q_b_proj.weight"].dtype == torch.int8
        assert t[f"{a}.kv_b_proj.weight"].dtype == torch.bfloat16
        assert desc[f"{a}.kv_b_proj.weight"] == "FLOAT"
        if f"{a}.indexer.wq_b.weight" in t:
            for lin in ("wq_b", "wk", "weights_proj"):
                assert desc[f"{a}.indexer.{lin}.weight"] == "FLOAT"
                assert t[f"{a}.indexer.{lin}.weight"].is_floating_point()
    return t


@pytest.mark.parametrize("model_type", TYPES)
def test_mindie_default_and_eval(tmp_path, capsys, model_type):
    """Default linears for MindIE: static W8A8 attention, the experts per token,
    no FA scales; >= 90 % of the linear weight elements int8; inspect accepts it;
    eval runs its linears. glm_moe_dsa has no MindIE model: refused."""
    src = save(tmp_path, model_type)
    out = tmp_path / "mindie"
    if model_type == "glm_moe_dsa":  # no MindIE model: refused before any work
        with pytest.raises(UnsupportedError, match="unsupported model type"):
            _run(src, out, tmp_path, target="mindie")
        assert not out.exists()
        return
    res = _run(src, out, tmp_path, target="mindie")
    _linears_only(out, model_type, "W8A8")
    desc = _desc(out)
    assert desc["model.layers.1.mlp.experts.7.down_proj.weight"] == "W8A8_DYNAMIC"
    assert desc["model.layers.1.self_attn.q_a_proj.weight"] == "W8A8"
    assert res.report["deployed"] == "none"
    fraction = int8_fraction(src, out)
    assert fraction >= 0.9, fraction
    assert main(["inspect", str(out), "--target", "mindie"]) == 0
    report = inspect_artifact(out, target="mindie")
    assert report["valid"], report["findings"]
    notes = " ".join(report.get("notes", []))
    assert not notes
    capsys.readouterr()
    js = tmp_path / "eval.json"
    args = ["eval", "--model", str(src), "--artifact", str(out), "--window", "24"]
    assert main([*args, "--max-tokens", "48", "-q", "--json", str(js)]) == 0
    assert "artifact mindie" in js.read_text()


@pytest.mark.parametrize("model_type", TYPES)
def test_vllm_ascend_w8a8_dynamic_and_inspect(tmp_path, model_type):
    src = save(tmp_path, model_type)
    out = tmp_path / "va"
    _run(src, out, tmp_path, target="vllm-ascend", linear="w8a8_dynamic")
    t = _linears_only(out, model_type, "W8A8_DYNAMIC")
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.int8
    report = inspect_artifact(out, target="vllm-ascend")
    assert report["valid"], report["findings"]
    for v in ("0.13.0", "0.18.0", "main"):
        rep = inspect_artifact(out, target="vllm-ascend", consumer_version=v)
        assert rep["valid"], (v, rep["findings"])


def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    src = save(tmp_path, "glm_moe_dsa")
    base = ["calibrate", "--model", str(src), "--num-samples", "4", "-q"]
    capsys.readouterr()  # the source's save, not the refusals
    for extra, what in (
        (["--target", "vllm-ascend", "--linear", "none"], "reads no attention"),
        (["--target", "mindie", "--linear", "none"], "has no model for it"),
        (["--target", "vllm", "--linear", "none"], "cannot express"),
    ):
        out = tmp_path / "o"
        assert main([*base, *extra, "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert what in err and len(err.splitlines()) == 1, err
        assert not out.exists()
    assert main(["emulate", "--model", str(src), "--prompt", "hi", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "paged emulation" in err and len(err.splitlines()) == 1


def test_streaming_glm_equals_whole_model(tmp_path):
    """The shared layers' top-k carried layer by layer (linears' calibration,
    streaming's layer-major pass) gives the whole-model artifact bit for bit."""
    src = tmp_path / "src"
    m = tiny("glm_moe_dsa", attn=None).to(torch.bfloat16)
    m.save_pretrained(src, max_shard_size="40KB")
    byte_tokenizer().save_pretrained(src)
    kw = dict(target="vllm-ascend", linear="w8a8_dynamic")
    whole = _run(src, tmp_path / "whole", tmp_path, **kw)
    streamed = _run(src, tmp_path / "stream", tmp_path, streaming=True, **kw)
    a, b = _tensors(whole.output), _tensors(streamed.output)
    assert a and set(a) == set(b)
    for name, t in a.items():
        assert torch.equal(
            t.view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)
        ), name
    assert _desc(whole.output) == _desc(streamed.output)


@pytest.mark.parametrize("model_type", TYPES)
def test_full_size_plan_quantizes_90_percent(model_type):
    """DeepSeek-V3.2 and GLM-5 at full size (transformers' config defaults) on the
    meta device: the linears the plan quantizes (attention groups and the routed
    experts) hold >= 90 % of the linear weight elements; kv_b_proj, the indexer
    and the routers stay float."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    plans = linear_plan(model)
    quantized = {n for p in plans for g in p.groups for n in g.linears}
    assert not [n for n in quantized if ".indexer." in n or "kv_b_proj" in n]
    first = cfg.first_k_dense_replace
    assert plans[first].experts is not None and plans[first - 1].experts is None
    fraction = plan_int8_fraction(model, head=False)
    assert fraction >= 0.9, fraction


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    """glm_moe_dsa (shared top-k layers) for vllm-ascend on 2 gloo ranks: the
    artifact of one process, bit for bit."""
    import torch.multiprocessing as mp
    from test_data_parallel import _worker

    src = save(tmp_path, "glm_moe_dsa")
    data = _data(tmp_path)
    kw = dict(RUN, target="vllm-ascend", linear="w8a8_dynamic", num_samples=6)
    kw.update(picture_report=False, progress=False)
    one = calibrate(src, output=tmp_path / "one", calib_data=data, **kw)
    args = (str(tmp_path / "store"), str(src), str(data), str(tmp_path / "two"), kw)
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    a, b = _tensors(one.output), _tensors(tmp_path / "two")
    assert a and set(a) == set(b)
    for name, t in a.items():
        assert torch.equal(
            t.view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)
        ), name


def test_eval_compare_methods_on_the_latent(tmp_path, capsys):
    """``eval --compare-methods`` calibrates FAKQuant on the MLA latent of a DSA
    model (observers sized for the R-wide latent; the GQA-only clip searches left
    out) and measures every method against float."""
    src = save(tmp_path, "glm_moe_dsa")
    js = tmp_path / "m.json"
    args = ["eval", "--model", str(src), "--compare-methods", "--num-samples", "4"]
    args += ["--max-length", "64", "--max-tokens", "48", "--window", "24", "-q"]
    assert main([*args, "--json", str(js)]) == 0, capsys.readouterr().err
    text = js.read_text()
    assert "recall_window/pooled (default)" in text and "clip search" not in text
