"""MindIE 3.0.0 per family: the table (:mod:`ascend_fa.artifact.mindie_models`)
agrees with the executable model of MindIE's loader (``mindie_loader``) and with
the registry; ``calibrate --target mindie`` writes what that loader loads (every
tensor it asks for present, every FA scale read) for DeepSeek-V3 (FAKQuant, static
W8A8, the routed experts W8A8_DYNAMIC under ``moe_quantize``, the shared experts in
the model-level W8A8) and the dense families, or exits 2 in one line before any
work; ``inspect --target mindie`` agrees. The MoE families are
``test_family_moe``'s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mindie_loader
import pytest
import torch
from builders import artifact_tensors, save_tiny
from mindie_loader import MindieLoadError, load_artifact, unread_fa
from safetensors.torch import save_file

from ascend_fa.artifact import DESCRIPTION_FILE, MINDIE_MODELS, inspect_artifact
from ascend_fa.artifact.release_types import MINDIE, MINDIE300
from ascend_fa.cli import main
from ascend_fa.families import FAMILIES, reads_fa

transformers = pytest.importorskip("transformers")

RUN = ["--num-samples", "4", "--max-length", "32", "--batch-size", "2"]
RUN += ["--heldout", "1", "--no-report", "-q"]
NO_MODEL = ("minimax_m2", "qwen3_next", "gemma3_text", "glm_moe_dsa", "qwen3_5")
NO_MODEL += (
    "qwen3_5_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "gpt_oss",
    "llama4_text",
    "gemma4_text",
)


def _calibrate(src: Path, out: Path, *extra: str) -> int:
    return main(["calibrate", "--model", str(src), *RUN, "--output", str(out), *extra])


def test_the_table_covers_the_registry_and_cites_mindie_3_0_0():
    assert set(MINDIE_MODELS) == set(FAMILIES)
    for t, m in MINDIE_MODELS.items():
        assert m.model_type == t and m.citations, t
        for c in m.citations:
            assert (c.repo, c.ref) == (MINDIE, MINDIE300) and c.where, (t, c)
        assert (m.model is None) == (t in NO_MODEL), t
        if m.model is not None:
            # the artifact carries FA scales exactly where MindIE builds FA3
            assert reads_fa(t, "mindie") == (m.fa3 is not None), t


@pytest.mark.parametrize(
    "model_type", [t for t, m in MINDIE_MODELS.items() if m.backend == "atb"]
)
def test_the_table_agrees_with_the_loader_model(model_type):
    m = MINDIE_MODELS[model_type]
    model = mindie_loader.ROUTES[model_type]
    assert model == m.model
    assert (model in mindie_loader.FA3) == (m.fa3 is not None)
    assert (model_type in mindie_loader.CONFIG_ONLY_ROUTERS) == (
        m.quantize_from == "config.json"
    )
    assert (model in mindie_loader.MOE_QUANTIZE_READERS) == m.moe_quantize
    assert mindie_loader.FORCED_DTYPE.get(model) == m.dtype
    assert mindie_loader.REQUIRED_CONFIG_KEYS.get(model, ()) == m.config_keys
    assert m.uniform == (model in mindie_loader.GRAPH_MODEL_LEVEL_EXPERTS)
    assert m.attn == mindie_loader.OWN_ATTN_QUANTIZE.get(model)
    assert m.attn_bias == (model in mindie_loader.ATTN_BIAS)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mindie_deepseek")
    src = save_tiny(root / "src", "deepseek_v3")
    art = root / "mindie"
    assert _calibrate(src, art) == 0
    return src, art


def test_deepseek_v3_loads_with_its_shared_experts_in_the_model_type(deepseek):
    """FAKQuant + static W8A8; the routed experts W8A8_DYNAMIC under
    ``moe_quantize``; the shared experts static W8A8 (loaded under the
    model-level ``quantize``, after MindIE restores it); every layer's FA3 read."""
    _, art = deepseek
    report = inspect_artifact(art, target="mindie")
    assert report["valid"], report["findings"]
    load = load_artifact(art)
    assert (load.model, load.quantize, load.fa_quant_type) == (
        "deepseekv2",
        "w8a8",
        "FAKQuant",
    )
    assert not unread_fa(art, load)
    desc = json.loads((art / DESCRIPTION_FILE).read_text())
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["moe_quantize"] == "w8a8_dynamic" and "quantize" not in cfg
    m = "model.layers.1.mlp"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        shared = f"{m}.shared_experts.{proj}"
        assert desc[f"{shared}.weight"] == "W8A8"
        assert load.asked[f"{shared}.deq_scale"] == "w8a8"
        assert load.asked[f"{m}.experts.3.{proj}.weight_scale"] == "w8a8_dynamic"
    for i in range(2):
        a = f"model.layers.{i}.self_attn"
        assert {f"{a}.fa_q.scale", f"{a}.fa_k.scale"} <= load.fa_read


def _dynamic_shared(art: Path, out: Path) -> None:
    """``art`` with its shared experts W8A8_DYNAMIC (the previous default): the
    static tensors gone, per-channel weight scales kept."""
    shutil.copytree(art, out)
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    tensors = artifact_tensors(out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    for n in list(tensors):
        if ".shared_experts." not in n:
            continue
        if n.endswith(("deq_scale", "quant_bias", "input_scale", "input_offset")):
            del tensors[n]
            desc.pop(n, None)
        elif n in desc:
            desc[n] = "W8A8_DYNAMIC"
    save_file(tensors, str(out / "quant_model_weights.safetensors"))
    (out / DESCRIPTION_FILE).write_text(json.dumps(desc))


def test_dynamic_shared_experts_fail_the_loader_and_inspect(deepseek, tmp_path):
    _, art = deepseek
    bad = tmp_path / "bad"
    _dynamic_shared(art, bad)
    want = "weight model.layers.1.mlp.shared_experts.gate_proj.deq_scale does not"
    with pytest.raises(MindieLoadError, match=want):
        load_artifact(bad)
    assert main(["inspect", str(bad), "--target", "mindie"]) == 1
    report = inspect_artifact(bad, target="mindie")
    assert any(
        "shared_experts" in f and "under quantize 'w8a8'" in f
        for f in report["findings"]
    ), report["findings"]


@pytest.mark.parametrize(
    "model_type",
    [
        "llama",
        pytest.param("qwen2", marks=pytest.mark.slow),
        pytest.param("qwen3", marks=pytest.mark.slow),
    ],
)
def test_dense_families_load_with_every_fa_scale_read(tmp_path, model_type):
    src = save_tiny(tmp_path / "src", model_type)
    art = tmp_path / "mindie"
    assert _calibrate(src, art) == 0
    assert inspect_artifact(art, target="mindie")["valid"]
    load = load_artifact(art)
    assert (load.quantize, load.fa_quant_type) == ("w8a8", "FAQuant")
    fa = {n for n in artifact_tensors(art) if ".fa_" in n}
    assert len(fa) == 2 * 6 and fa == load.fa_read
    assert load.model == MINDIE_MODELS[model_type].model


@pytest.mark.parametrize("model_type", NO_MODEL)
def test_no_mindie_model_is_refused_before_any_work(tmp_path, capsys, model_type):
    src = tmp_path / "src"
    src.mkdir()  # config.json alone: refused before the model is read
    (src / "config.json").write_text(json.dumps({"model_type": model_type}))
    out = tmp_path / "out"
    assert _calibrate(src, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert model_type in err[0] and "MindIE 3.0.0" in err[0]
    assert "unsupported model type" in err[0] and "--target vllm-ascend" in err[0]


@pytest.mark.parametrize("model_type", NO_MODEL)
def test_inspect_refuses_an_artifact_of_a_family_without_model(
    deepseek, tmp_path, capsys, model_type
):
    """``inspect`` agrees with ``calibrate``: the same files under another
    ``model_type`` MindIE has no model for are invalid (exit 1)."""
    _, art = deepseek
    other = tmp_path / model_type
    shutil.copytree(art, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg.pop("architectures", None)
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MindieLoadError, match="unsupported model type"):
        load_artifact(other)
    assert main(["inspect", str(other), "--target", "mindie"]) == 1
    assert "has no model for it" in capsys.readouterr().out


def test_a_research_run_is_not_refused_and_inspect_refuses_it(tmp_path):
    """``--dtype fp32`` (a research artifact, never deployed) writes for a family
    MindIE has no model for; ``inspect --target mindie`` then says why not."""
    from builders import byte_tokenizer, tiny_causal_lm

    src = tmp_path / "src"
    cfg = dict(vocab_size=260, hidden_size=32, intermediate_size=48, head_dim=8)
    cfg.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = tiny_causal_lm("gemma3_text", attn=None, **cfg)
    model.to(torch.bfloat16).save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    out = tmp_path / "out"
    assert _calibrate(src, out, "--dtype", "fp32") == 0
    report = inspect_artifact(out, target="mindie")
    assert not report["valid"]
    assert any("has no model for it" in f for f in report["findings"])


@pytest.mark.parametrize("model_type", NO_MODEL)
def test_attention_only_runs_of_a_family_without_model_are_refused(
    tmp_path, capsys, model_type
):
    """``--linear none`` is no way around a family MindIE has no model for: only a
    research run (``--dtype fp32``) writes its layout."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": model_type}))
    out = tmp_path / "out"
    assert _calibrate(src, out, "--linear", "none") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert "has no model for it" in err[0] and model_type in err[0]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "mixtral"])
def test_float_linears_where_no_fa3_is_built_are_refused(tmp_path, capsys, model_type):
    """An attention-only artifact (``--linear none``) of a model without FA3 would
    carry nothing MindIE uses: one line before any work."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": model_type}))
    out = tmp_path / "out"
    assert _calibrate(src, out, "--linear", "none") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert "builds no FA3" in err[0] and model_type in err[0]


def test_mistral_is_refused_before_any_work(tmp_path, capsys):
    """MindIE's mistral router reads config.json only (LlamaConfig.from_pretrained):
    neither the description's linear type nor its FA scheme; one line, nothing
    written. ``inspect`` refuses the same files (a llama artifact under
    ``model_type`` mistral), and the loader model stops where MindIE does."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    out = tmp_path / "out"
    assert _calibrate(src, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert "mistral" in err[0] and "router_mistral.py" in err[0]
