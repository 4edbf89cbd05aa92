"""Gemma 4 (``gemma4_text``): sliding and full layers, each with its own head_dim
and KV-head count; on ``attention_k_eq_v`` full layers there is no ``v_proj`` (V
is K's projection, normed by a scale-free ``v_norm``, without RoPE).

A tiny random model (3 layers: sliding, k_eq_v full, full as transformers forces
the last) is calibrated for ``--target vllm`` (FP8 KV-cache scales, loaded by the
real vLLM 0.32 in ``tests/test_vllm_families.py``): one K and one V scale per
layer, each from the K / V the layer's attention receives. The scales are
checked against an independent reference: the maximum of |K| (K through every
RoPE pair's norm, which bounds K at every position) and |V|, captured by a hook
on the attention interface over the same calibration tokens, divided by 448.

No Ascend consumer quantizes Gemma 4 here: vllm-ascend has no gemma4 mapping up
to 0.23.0.post1, and main's has no linear / C8 plan of ours judged by its loader
(rule ``quant.gemma4-no-plan``); MindIE 3.0.0 has no model. Both refuse in one
line, ``inspect`` agrees, ``eval`` runs on the FP8 artifact. The tiny model shows
only that the path runs, not accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import byte_tokenizer, tiny_causal_lm
from safetensors.torch import load_file

from ascend_fa.adapters import get_adapter
from ascend_fa.artifact import inspect_artifact
from ascend_fa.cli import main
from ascend_fa.families import GEMMA4, attention_kind

CONFIG = dict(
    vocab_size=260, max_position_embeddings=256, hidden_size=64,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
    attention_k_eq_v=True, tie_word_embeddings=False, intermediate_size=32,
    sliding_window=8, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=260,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
)  # fmt: skip
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
]
ARGS = ["--num-samples", "2", "--max-length", "16", "--batch-size", "2"]
ARGS += ["--heldout", "0", "--no-report", "-q"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gemma4")
    path = root / "src"
    tiny_causal_lm("gemma4_text", attn=None, **CONFIG).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    (root / "calib.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in TEXTS)
    )
    return path


@pytest.fixture(scope="module")
def artifact(src) -> Path:
    out = src.parent / "vllm"
    argv = ["calibrate", "--model", str(src), *ARGS, "--target", "vllm"]
    argv += ["--calib-data", str(src.parent / "calib.jsonl")]
    assert main([*argv, "--output", str(out)]) == 0
    return out


def test_family_is_data(src):
    import transformers

    assert attention_kind("gemma4_text") is GEMMA4
    assert GEMMA4.fa_targets == () and GEMMA4.kv_cache_targets
    net = transformers.AutoModelForCausalLM.from_pretrained(src)
    adapter = get_adapter(net)
    modules = dict(adapter.attention_modules(net))
    assert list(modules) == [f"model.layers.{i}.self_attn" for i in range(3)]
    # each layer's own heads: the sliding layer 2 KV heads of 32, the k_eq_v
    # full layers 1 KV head of 64 and no v_proj
    counts = [adapter.head_counts(m) for m in modules.values()]
    assert counts[0] == {"fa_q": (4, 32), "fa_k": (2, 32), "fa_v": (2, 32)}
    assert counts[1] == {"fa_q": (4, 64), "fa_k": (1, 64), "fa_v": (1, 64)}
    assert modules["model.layers.1.self_attn"].v_proj is None


def _reference_scales(src: Path) -> dict[str, tuple[float, float]]:
    """max K pair norm / 448 and max |V| / 448 per layer on the calibration
    tokens (BOS + the byte tokens of each text, cut at --max-length), read at
    ``k_norm`` / ``v_norm``: RoPE turns each rotate-half pair ``(d, d + D/2)``
    and keeps its norm, so the pair norms before RoPE are those after."""
    import transformers

    net = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    seen: dict[str, list[float]] = {}

    def observe(name: str, side: int):
        def hook(module, args, out):
            x = out.float()
            if side == 0:
                half = x.shape[-1] // 2
                x = torch.hypot(x[..., :half], x[..., half:])
            got = seen.setdefault(name, [0.0, 0.0])
            got[side] = max(got[side], float(x.abs().max()))

        return hook

    handles = []
    for i, layer in enumerate(net.model.layers):
        name = f"model.layers.{i}.self_attn"
        attn = layer.self_attn
        handles.append(attn.k_norm.register_forward_hook(observe(name, 0)))
        handles.append(attn.v_norm.register_forward_hook(observe(name, 1)))
    with torch.no_grad():
        for text in TEXTS:
            net(input_ids=tok(text, return_tensors="pt").input_ids[:, :16])
    for h in handles:
        h.remove()
    return {a: (k / 448.0, v / 448.0) for a, (k, v) in seen.items()}


def test_vllm_artifact_scales_per_layer(src, artifact):
    tensors = load_file(str(artifact / "quant_model_weights.safetensors"))
    attn = sorted(n[: -len(".k_scale")] for n in tensors if n.endswith(".k_scale"))
    assert attn == [f"model.layers.{i}.self_attn" for i in range(3)]
    ref = _reference_scales(src)
    for a in attn:
        k, v = (tensors[f"{a}.{s}_scale"].float() for s in "kv")
        assert k.shape == v.shape == (1,)
        torch.testing.assert_close(k.item(), ref[a][0], rtol=1e-3, atol=0)
        torch.testing.assert_close(v.item(), ref[a][1], rtol=1e-3, atol=0)
    # the k_eq_v layer's V (v_norm of the K projection, no RoPE) is its own
    assert tensors["model.layers.1.self_attn.v_scale"].item() != pytest.approx(
        tensors["model.layers.1.self_attn.k_scale"].item()
    )
    # config.json keeps the source's per-layer-type RoPE (no transformers-4 keys:
    # Gemma 4 has no transformers-4 model) and the compressed-tensors KV scheme
    config = json.loads((artifact / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert config["rope_parameters"] == source["rope_parameters"]
    assert "rope_scaling" not in config and "rope_theta" not in config
    assert config["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    assert inspect_artifact(artifact, target="vllm")["findings"] == []


@pytest.mark.parametrize("release", ["0.13.0", "0.18.0", "0.23.0.post1", "main"])
def test_vllm_ascend_refuses_in_one_line(src, release, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["calibrate", "--model", str(src), *ARGS, "--target", "vllm-ascend"]
    rc = main([*argv, "--consumer-version", release, "--output", str(out)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists(), line
    assert release in line and "Gemma4ForCausalLM" in line
    assert "quant.gemma4-no-plan" in line and "--target vllm" in line


def test_mindie_refuses_and_inspect_agrees(src, artifact, tmp_path, capsys):
    out = tmp_path / "mindie"
    argv = ["calibrate", "--model", str(src), *ARGS, "--target", "mindie"]
    rc = main([*argv, "--linear", "w8a8", "--output", str(out)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists(), line
    assert "MindIE 3.0.0" in line and "gemma4_text" in line and "no model" in line
    report = inspect_artifact(
        artifact, target="vllm-ascend", consumer_version="0.23.0.post1"
    )
    assert any("quant.gemma4-no-plan" in f for f in report["findings"]), report
    assert main(["inspect", str(artifact), "--target", "vllm-ascend"]) == 1
    capsys.readouterr()


def test_eval_runs_on_the_fp8_artifact(src, artifact, tmp_path):
    data = tmp_path / "held.txt"
    data.write_text(" ".join(TEXTS) * 4)
    report = tmp_path / "eval.json"
    argv = ["eval", "--model", str(src), "--artifact", str(artifact), "-q"]
    argv += ["--data", str(data), "--window", "32", "--max-tokens", "96"]
    assert main([*argv, "--fp8-rounding", "trunc", "--json", str(report)]) == 0
    assert report.exists()
