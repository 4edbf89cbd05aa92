"""The GQA + MoE families (qwen3_moe, qwen2_moe, glm4_moe, mixtral, minimax_m2) and
MoE experts quantized by default.

From a tiny random checkpoint of each family MindIE 3.0.0 runs: ``calibrate
--target mindie`` (the default linears) writes what MindIE's model for it loads
(:mod:`ascend_fa.artifact.mindie_models`): the routed experts W8A8_DYNAMIC, under
static W8A8 attention where the model reads ``moe_quantize`` (glm4_moe, its shared
experts in the model-level W8A8, zero q/k/v biases) or picks static attention
itself under ``quantize`` w8a8_dynamic (qwen2_moe, qwen3_moe: every MLP linear per
token), everything W8A8_DYNAMIC where it loads every linear under one ``quantize``
(mixtral), no FA scales (none of
these models builds FA3), the config.json keys its router needs and the source's
others kept. The executable model of MindIE's loader (``mindie_loader``) loads
each artifact and finds every tensor it asks for; ``inspect`` accepts it; at least
90 % of the linear weight elements are int8 and every expert's codes equal a naive
per-row quantizer. MiniMax-M2 has no MindIE model: refused. ``--target vllm``
passes; ``eval``'s loader rebuilds the model; ``--streaming`` is bit-equal to the
whole-model path. DeepSeek-V3 at its real size has >= 90 % of its linear weight
elements int8 under the default plan.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from builders import (
    MOE_TINY,
    artifact_tensors,
    int8_fraction,
    plan_int8_fraction,
    save_tiny_moe,
)
from mindie_loader import MindieLoadError, load_artifact, unread_fa

from ascend_fa.artifact import DESCRIPTION_FILE, MINDIE_MODELS, inspect_artifact
from ascend_fa.cli import main
from ascend_fa.families import moe_layout
from ascend_fa.linear import W8A8DynamicExperts, artifact_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="fused MoE experts are transformers 5's layout",
)

FAMILIES = tuple(MOE_TINY)
#: the families MindIE 3.0.0 has a model for
MINDIE_FAMILIES = tuple(t for t in FAMILIES if MINDIE_MODELS[t].model is not None)
#: model type -> (model_quant_type, shared experts, config.json keys added)
EXPECTED = {
    "qwen3_moe": ("W8A8", None, {"quantize": "w8a8_dynamic", "num_experts": 4}),
    "qwen2_moe": ("W8A8", "W8A8_DYNAMIC", {"quantize": "w8a8_dynamic"}),
    "glm4_moe": ("W8A8", "W8A8", {"moe_quantize": "w8a8_dynamic",
                                  "rope_scaling": None, "attention_bias": True}),
    "mixtral": ("W8A8_DYNAMIC", None, {}),
}  # fmt: skip
RUN = ["--num-samples", "4", "--max-length", "32", "--batch-size", "2"]
RUN += ["--heldout", "1", "--no-report", "-q"]


def _calibrate(src: Path, out: Path, *extra: str) -> int:
    return main(["calibrate", "--model", str(src), *RUN, "--output", str(out), *extra])


def _naive(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row: scale = max|row| / 127 rounded up to bf16 (the next bf16 when
    rounding to nearest fell below), codes = round(w / scale) in [-128, 127]."""
    w = w.float()
    codes = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.bfloat16)
    for r in range(w.shape[0]):
        exact = float(w[r].abs().max()) / 127.0
        s = torch.tensor(exact).to(torch.bfloat16)
        if float(s) < exact:
            s = torch.nextafter(s, torch.tensor(float("inf"), dtype=torch.bfloat16))
        scales[r] = s
        codes[r] = torch.clamp(torch.round(w[r] / float(s)), -128, 127).to(torch.int8)
    return codes, scales


@pytest.fixture(scope="module")
def mindie(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Every MindIE family's source checkpoint and default mindie artifact."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for model_type in MINDIE_FAMILIES:
        src = save_tiny_moe(root / f"{model_type}-src", model_type)
        art = root / f"{model_type}-mindie"
        assert _calibrate(src, art) == 0, model_type
        out[model_type] = (src, art)
    return out


@pytest.mark.parametrize("model_type", MINDIE_FAMILIES)
def test_mindie_default_is_what_mindie_loads(mindie, model_type):
    src, art = mindie[model_type]
    report = inspect_artifact(art, target="mindie")
    assert report["valid"], report["findings"]
    load = load_artifact(art)
    assert load.fa_quant_type is None and not unread_fa(art, load)
    mqt, shared_type, added = EXPECTED[model_type]
    desc = json.loads((art / DESCRIPTION_FILE).read_text())
    assert desc["model_quant_type"] == mqt and "fa_quant_type" not in desc
    tensors = artifact_tensors(art)
    source = artifact_tensors(src)
    assert not [n for n in tensors if ".fa_" in n]
    layout = moe_layout(model_type)
    block = layout.checkpoint_block
    fraction = int8_fraction(src, art)
    assert fraction >= 0.9, (model_type, fraction)
    gate, up, down = layout.projections
    experts = [n for n in source if f".{block}.experts." in n]
    assert experts and all(n.split(".")[-2] in (gate, up, down) for n in experts)
    for name in experts:
        assert desc[name] == "W8A8_DYNAMIC", name
        assert load.asked[name] == "w8a8_dynamic", name
        prefix = name.removesuffix(".weight")
        codes, scales = _naive(source[name])
        assert torch.equal(tensors[name], codes), name
        assert torch.equal(tensors[f"{prefix}.weight_scale"].reshape(-1), scales)
        assert not tensors[f"{prefix}.weight_offset"].any()
    attn = sorted({n.rsplit(".", 2)[0] for n in source if n.endswith("o_proj.weight")})
    assert len(attn) == 4
    for a in attn:
        assert desc[f"{a}.q_proj.weight"] == mqt
    routers = [n for n in source if n.endswith(f"{block}.gate.weight")]
    assert routers and all(desc[n] == "FLOAT" for n in routers)
    for n in (n for n in source if "shared_expert_gate" in n):
        assert desc[n] == "FLOAT", n
    shared = [n for n in source if "shared_expert" in n and n.endswith("proj.weight")]
    assert bool(shared) == (shared_type is not None)
    for n in shared:
        assert desc[n] == shared_type and load.asked[n] == shared_type.lower(), n
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((art / "config.json").read_text())
    for key, value in added.items():
        assert key in cfg and cfg[key] == value, key
    assert "moe_quantize" in cfg or "moe_quantize" not in added
    for key, value in src_cfg.items():
        if key not in ("torch_dtype", "dtype", *added):
            assert cfg[key] == value, key
    # besides the router's keys: the transformers-4 RoPE keys (model_files)
    rope = {"rope_theta", "rope_scaling", "partial_rotary_factor"}
    assert set(cfg) - set(src_cfg) <= {"torch_dtype", *rope, *added}


def test_minimax_m2_has_no_mindie_model(tmp_path, capsys):
    src = save_tiny_moe(tmp_path / "src", "minimax_m2")
    out = tmp_path / "out"
    assert _calibrate(src, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert "minimax_m2" in err[0] and "MindIE 3.0.0" in err[0]
    assert "--target vllm-ascend" in err[0] and "unsupported model type" in err[0]


def _add_fa(art: Path, out: Path) -> None:
    """``art`` with FAQuant scales on every attention layer (what the previous
    release wrote for these families)."""
    from safetensors.torch import save_file

    shutil.copytree(art, out)
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    desc["fa_quant_type"] = "FAQuant"
    tensors = artifact_tensors(out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    for n in [n for n in tensors if n.endswith("o_proj.weight")]:
        a = n.removesuffix(".o_proj.weight")
        for b, heads in (("q", 4), ("k", 2), ("v", 2)):
            tensors[f"{a}.fa_{b}.scale"] = torch.full((heads, 1), 0.01)
            tensors[f"{a}.fa_{b}.offset"] = torch.zeros((heads, 1), dtype=torch.int8)
            desc[f"{a}.fa_{b}.scale"] = desc[f"{a}.fa_{b}.offset"] = "FAQuant"
    save_file(tensors, str(out / "quant_model_weights.safetensors"))
    (out / DESCRIPTION_FILE).write_text(json.dumps(desc))
    index = out / "quant_model_weights.safetensors.index.json"
    index.unlink(missing_ok=True)


@pytest.mark.parametrize("model_type", ["mixtral", "glm4_moe", "qwen3_moe"])
def test_fa_the_moe_model_ignores_is_refused(mindie, tmp_path, capsys, model_type):
    _, art = mindie[model_type]
    bad = tmp_path / "fa"
    _add_fa(art, bad)
    load = load_artifact(bad)
    assert len(unread_fa(bad, load)) == 4  # loaded by none of the layers
    assert main(["inspect", str(bad), "--target", "mindie"]) == 1
    out = capsys.readouterr().out
    assert "builds no FA3" in out and "[mindie.fa3.moe]" in out


def test_glm4_moe_without_moe_quantize_or_rope_scaling(mindie, tmp_path):
    _, art = mindie["glm4_moe"]
    for key in ("moe_quantize", "rope_scaling"):
        bad = tmp_path / key
        shutil.copytree(art, bad)
        cfg = json.loads((bad / "config.json").read_text())
        del cfg[key]
        (bad / "config.json").write_text(json.dumps(cfg))
        report = inspect_artifact(bad, target="mindie")
        assert not report["valid"]
        assert any(key in f for f in report["findings"]), report["findings"]
        with pytest.raises(MindieLoadError):
            load_artifact(bad)


def test_qwen3_moe_without_quantize_fails_the_loader(mindie, tmp_path):
    """The qwen MoE router reads no description: without config.json's
    ``quantize`` the model is built float and the first int8 weight stops it."""
    _, art = mindie["qwen3_moe"]
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantize"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MindieLoadError, match="linear type not matched"):
        load_artifact(bad)
    report = inspect_artifact(bad, target="mindie")
    assert not report["valid"]
    assert any("quantize is None" in f for f in report["findings"])


@pytest.mark.parametrize("model_type", ["mixtral"])
def test_static_w8a8_is_refused_where_one_quantize_loads_all(
    tmp_path, capsys, model_type
):
    src = tmp_path / "src"
    src.mkdir()
    cfg = {"model_type": model_type, **MOE_TINY[model_type]}
    (src / "config.json").write_text(json.dumps(cfg))  # refused before any load
    out = tmp_path / "out"
    assert _calibrate(src, out, "--linear", "w8a8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert model_type in err[0] and "--linear w8a8_dynamic" in err[0]


@pytest.mark.parametrize("model_type", MINDIE_FAMILIES)
def test_eval_loader_rebuilds_the_quantized_experts(mindie, model_type):
    from ascend_fa.models import load_model

    src, art = mindie[model_type]
    loaded = load_model(str(src))
    model = artifact_model(loaded.model, art)
    placed = model.get_submodule("model.layers.3.mlp.experts")
    assert isinstance(placed, W8A8DynamicExperts)
    reference = load_model(str(src)).model
    ids = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(input_ids=ids).logits.float()
        b = reference(input_ids=ids).logits.float()
    assert torch.isfinite(a).all() and not torch.equal(a, b)
    # int8 linears, FA points and bf16 activations on a random 4-layer model
    assert float((a - b).norm() / b.norm()) < 0.1


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_vllm_target_passes(tmp_path, model_type):
    src = save_tiny_moe(tmp_path / "src", model_type)
    out = tmp_path / "vllm"
    assert _calibrate(src, out, "--target", "vllm") == 0
    report = inspect_artifact(out, target="vllm")
    assert report["valid"], report["findings"]


def test_vllm_ascend_c8_follows_the_release_table(tmp_path, capsys):
    glm = save_tiny_moe(tmp_path / "glm", "glm4_moe")
    out = tmp_path / "glm-c8"
    assert _calibrate(glm, out, "--target", "vllm-ascend") == 0  # 0.23 patched it
    assert inspect_artifact(out, target="vllm-ascend")["valid"]
    # partial RoPE (factor 0.5 of head_dim 16): K's range comes from the norms of
    # the rotate-half pairs (d, d + 4) of the first 8 channels only; the other 8
    # channels are not rotated and keep their own range
    name = "model.layers.1.self_attn.k_proj.kv_cache_scale"
    k = artifact_tensors(out)[name].float().reshape(2, 16)
    assert torch.equal(k[:, :4], k[:, 4:8])
    assert not torch.equal(k[:, :8], k[:, 8:])
    mixtral = save_tiny_moe(tmp_path / "mixtral", "mixtral")
    refused = tmp_path / "refused"
    assert _calibrate(mixtral, refused, "--target", "vllm-ascend") == 2
    err = capsys.readouterr().err
    assert "MixtralForCausalLM" in err and "0.25.1rc1" in err
    assert not refused.exists()
    later = ["--consumer-version", "0.25.1rc1"]
    assert _calibrate(mixtral, refused, "--target", "vllm-ascend", *later) == 0


def test_streaming_is_bit_equal_to_the_whole_model(mindie, tmp_path):
    src, art = mindie["qwen2_moe"]
    out = tmp_path / "streamed"
    assert _calibrate(src, out, "--streaming") == 0
    a, b = artifact_tensors(art), artifact_tensors(out)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((art / DESCRIPTION_FILE).read_text()) == json.loads(
        (out / DESCRIPTION_FILE).read_text()
    )


def test_deepseek_v3_at_full_size_is_mostly_int8():
    """DeepSeek-V3's real shapes on the meta device: the default plan (static
    attention and dense MLPs, per-token routed and shared experts, kv_b_proj and
    the routers float) covers >= 90 % of the linear weight elements; MindIE's
    (shared experts in the model-level type) the same groups."""
    from ascend_fa.linear import linear_plan

    # transformers' DeepseekV3Config defaults are DeepSeek-V3's own sizes
    cfg = transformers.AutoConfig.for_model("deepseek_v3")
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_hidden_layers) == (
        7168,
        256,
        61,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    plans = linear_plan(model)
    assert plans[3].experts is not None and plans[2].experts is None
    fraction = plan_int8_fraction(model)
    assert fraction >= 0.9, fraction
    kinds = {g.kind: g.dynamic for g in plans[3].groups}
    assert kinds["shared_gate_up"] and kinds["shared_down"]
    mindie = linear_plan(model, shared_dynamic=False)
    kinds = {g.kind: g.dynamic for g in mindie[3].groups}
    assert not kinds["shared_gate_up"] and not kinds["shared_down"]
    assert [g.name for g in mindie[3].groups] == [g.name for g in plans[3].groups]
