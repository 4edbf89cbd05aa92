"""The GQA + MoE families (qwen3_moe, qwen2_moe, glm4_moe, mixtral, minimax_m2) and
MoE experts quantized by default.

From a tiny random checkpoint of each family: ``calibrate --target mindie`` (the
default linears) writes an artifact ``inspect`` accepts, with the routed and shared
experts W8A8_DYNAMIC next to static W8A8 attention (msModelSlim's MoE mix), at
least 90 % of the linear weight elements int8, every expert's codes equal to a naive
per-row quantizer of the source checkpoint's tensor, the experts under the
checkpoint names the consumers load, FA scales on every attention layer, and the
source config.json kept. ``--target vllm`` passes; ``eval``'s loader rebuilds the
model; ``--streaming`` is bit-equal to the whole-model path. DeepSeek-V3 at its
real size has >= 90 % of its linear weight elements int8 under the default plan.
"""

from __future__ import annotations

import json
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

from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact
from ascend_fa.cli import main
from ascend_fa.families import moe_layout
from ascend_fa.linear import W8A8DynamicExperts, artifact_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="fused MoE experts are transformers 5's layout",
)

FAMILIES = tuple(MOE_TINY)
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
    """Every family's source checkpoint and default mindie artifact."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for model_type in FAMILIES:
        src = save_tiny_moe(root / f"{model_type}-src", model_type)
        art = root / f"{model_type}-mindie"
        assert _calibrate(src, art) == 0, model_type
        out[model_type] = (src, art)
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_mindie_default_quantizes_the_experts(mindie, model_type):
    src, art = mindie[model_type]
    report = inspect_artifact(art, target="mindie")
    assert report["valid"], report["findings"]
    desc = json.loads((art / DESCRIPTION_FILE).read_text())
    assert desc["model_quant_type"] == "W8A8"
    tensors = artifact_tensors(art)
    source = artifact_tensors(src)
    layout = moe_layout(model_type)
    block = layout.checkpoint_block
    fraction = int8_fraction(src, art)
    assert fraction >= 0.9, (model_type, fraction)
    gate, up, down = layout.projections
    experts = [n for n in source if f".{block}.experts." in n]
    assert experts and all(n.split(".")[-2] in (gate, up, down) for n in experts)
    for name in experts:
        assert desc[name] == "W8A8_DYNAMIC", name
        prefix = name.removesuffix(".weight")
        codes, scales = _naive(source[name])
        assert torch.equal(tensors[name], codes), name
        assert torch.equal(tensors[f"{prefix}.weight_scale"].reshape(-1), scales)
        assert not tensors[f"{prefix}.weight_offset"].any()
    attn = sorted({n.rsplit(".", 2)[0] for n in source if n.endswith("o_proj.weight")})
    assert len(attn) == 4
    for a in attn:
        assert desc[f"{a}.q_proj.weight"] == "W8A8"
        for b in ("fa_q", "fa_k", "fa_v"):
            assert f"{a}.{b}.scale" in tensors, (a, b)
    routers = [n for n in source if n.endswith(f"{block}.gate.weight")]
    assert routers and all(desc[n] == "FLOAT" for n in routers)
    for n in (n for n in source if "shared_expert_gate" in n):
        assert desc[n] == "FLOAT", n
    for n in (n for n in source if "shared_expert" in n and "gate." not in n):
        if n.endswith("proj.weight"):
            assert desc[n] == "W8A8_DYNAMIC", n
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["moe_quantize"] == "w8a8_dynamic"
    for key, value in src_cfg.items():
        if key not in ("torch_dtype", "dtype"):
            assert cfg[key] == value, key


def test_mindie_notes_where_the_release_leaves_fa_unused(mindie, capsys):
    _, art = mindie["mixtral"]
    assert main(["inspect", str(art), "--target", "mindie"]) == 0
    out = capsys.readouterr().out
    assert "note: mindie 3.0.0 loads FAQuant for MixtralForCausalLM" in out
    assert "[mindie.fa3.moe]" in out and "valid" in out


def test_mindie_without_moe_quantize_is_a_finding(mindie, tmp_path):
    import shutil

    _, art = mindie["qwen3_moe"]
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["moe_quantize"]
    (bad / "config.json").write_text(json.dumps(cfg))
    report = inspect_artifact(bad, target="mindie")
    assert not report["valid"]
    assert any("moe_quantize" in f for f in report["findings"])


@pytest.mark.parametrize("model_type", FAMILIES)
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
    the routers float) covers >= 90 % of the linear weight elements."""
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
