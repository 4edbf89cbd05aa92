"""FAKQuant (DeepSeek MLA) through the ascend-fa vLLM plugin (slow suite).

The environment and the overlay are ``tests/test_vllm_serving.py``'s fixtures;
engines run in ``tests/vllm_mla_driver.py``. The model is a tiny DeepSeek-V3
(2 dense layers, 4 heads, ``R`` = 512, ``Dr`` = 64: the latent width vLLM's MLA
backends accept), calibrated here with ``ascend-fa calibrate`` for MindIE (W8A8
linears + FAKQuant, the query quantized with ``fa_q``) and for vllm-ascend
(W8A8_DYNAMIC linears + FAKQuant, the query quantized per token and head at run
time, as vllm-ascend's MLA does).

vLLM 0.32.0's CPU rotary kernel (``vllm._custom_ops.rotary_embedding``, the
``forward_cpu`` of ``RotaryEmbedding``) rotates a 3-D query ``[T, H, Dr]`` with
``H > 1`` differently from the same layer's ``forward_native`` (the 2-D
``[T, H*Dr]`` query of the GQA models agrees), and vLLM's MLA wrapper passes it
that 3-D query (``vllm/model_executor/layers/mla.py``
``MultiHeadLatentAttentionWrapper.forward``). DeepSeek's logprobs in vLLM on a
CPU then differ from transformers' by far more than bf16 noise, with or without
the plugin (printed by :func:`test_bf16_noise_mla`). The fidelity runs therefore
use vLLM's own PyTorch RoPE (``compilation_config={"custom_ops":
["-rotary_embedding"]}``, a vLLM option; the plugin changes nothing there).

Checked: the artifact serves with ``quantization="ascend"``; its per-token
logprobs equal ``ascend-fa eval``'s fake-quant of the same artifact (its
quantized linears, ``fa_q`` -- or eval's dynamic per-token point for the
vllm-ascend artifact -- on the absorbed query, ``fa_k`` on the latent) within
``LOGPROB_BOUND``; the int8 latent codes read back from vLLM's cache equal
``reshape_and_cache_mla``'s and a naive loop's bit for bit, and the RoPE part is
stored unchanged; the NZ cache layout gives the ND outputs exactly; an artifact
whose FAKQuant tensors disagree with the description, and a block size the int8
cache cannot use (vLLM's reference ``CPU_MLA`` backend forces 16), stop at
start-up with one line. On a CPU without AMX vLLM picks ``CPU_MLA`` (block size
16) for every MLA model, so the serving checks skip there with the refusal's line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_vllm_serving import (
    BF16_NOISE_BOUND,
    LOGPROB_BOUND,
    MAX_TOKENS,
    TEXTS,
    TOP_K,
    _prompts,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "vllm_mla_driver.py"
#: DeepSeek-V3, dense (``first_k_dense_replace`` = layers), MLA at the widths
#: vLLM's MLA backends take (``R + Dr`` = 576).
DEEPSEEK = dict(
    vocab_size=260, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
    v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=2, max_position_embeddings=1024,
)  # fmt: skip
#: vLLM's PyTorch RoPE instead of its CPU kernel (module doc).
NATIVE_ROPE = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}


def _source(path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from builders import byte_tokenizer, tiny_causal_lm

    model = tiny_causal_lm("deepseek_v3", attn=None, **DEEPSEEK)
    with torch.no_grad():  # sharper attention, so the latent cache moves the logits
        for name, p in model.named_parameters():
            if "proj" in name and p.dim() == 2:
                p.mul_(3.0)
    model.to(torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _bad_fa_k(src: Path, out: Path) -> Path:
    """A copy of ``src`` whose layer-1 ``fa_k.scale`` holds two latent heads."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    path = out / "quant_model_weights.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.fa_k.scale"
    tensors[name] = tensors[name].repeat(2, 1)
    save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def mla_artifacts(tmp_path_factory) -> dict:
    from ascend_fa.cli import main

    root = tmp_path_factory.mktemp("mla")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = {"src": _source(root / "src")}
    common = ["--model", str(out["src"]), "--calib-data", str(calib),
              "--num-samples", "8", "--max-length", "48", "--heldout", "0",
              "--no-report", "-q"]  # fmt: skip
    jobs = {
        "fak": ["--linear", "w8a8"],
        "fak_va": ["--linear", "w8a8_dynamic", "--target", "vllm-ascend",
                   "--consumer-version", "main"],
    }  # fmt: skip
    for name, args in jobs.items():
        out[name] = root / name
        assert main(["calibrate", *common, *args, "--output", str(out[name])]) == 0
    out["bad_fa_k"] = _bad_fa_k(out["fak"], root / "bad_fa_k")
    return out


def drive(python: Path, runs: list, tmp: Path, site: Path) -> dict:
    """Run the MLA driver on ``runs`` with the plugin's overlay ``site``."""
    req = {"runs": runs, "prompts": _prompts(), "max_tokens": MAX_TOKENS,
           "logprobs": TOP_K}  # fmt: skip
    path = tmp / "req.json"
    path.write_text(json.dumps(req))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=str(site))
    proc = subprocess.run(
        [str(python), str(DRIVER), str(path)], capture_output=True, text=True,
        timeout=1800, env=env, cwd=str(tmp),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mla_engine(request, mla_artifacts, tmp_path_factory) -> dict:
    """One process: the float source, the artifact with the plugin (ND with the
    probe, NZ) and the refusals, all on vLLM's PyTorch RoPE (vLLM fixes its
    custom ops at the first engine of a process: ``get_cached_compilation_
    config``); another process: the float source on vLLM's CPU rotary kernel."""
    # the environment fixtures of test_vllm_serving.py (imported above)
    python = request.getfixturevalue("vllm_python")
    site = request.getfixturevalue("overlay")
    tmp = tmp_path_factory.mktemp("mla_drive")
    fak, src = str(mla_artifacts["fak"]), str(mla_artifacts["src"])
    runs = {
        "float": {"model": src, "llm_kwargs": NATIVE_ROPE},
        "fak": {"model": fak, "quantization": "ascend", "llm_kwargs": NATIVE_ROPE,
                "mla_probe": str(tmp / "fak.pt")},
        "fak_va": {"model": str(mla_artifacts["fak_va"]), "quantization": "ascend",
                   "llm_kwargs": NATIVE_ROPE},
        "fak_nz": {"model": fak, "quantization": "ascend", "llm_kwargs": NATIVE_ROPE,
                   "env": {"ASCEND_FA_VLLM_KV_LAYOUT": "nz"}},
        "bad_fa_k": {"model": str(mla_artifacts["bad_fa_k"]),
                     "quantization": "ascend"},
        "block16": {"model": fak, "quantization": "ascend",
                    "llm_kwargs": {"attention_backend": "CPU_MLA"}},
    }  # fmt: skip
    got = drive(python, list(runs.values()), tmp, site)
    out = dict(zip(runs, got["runs"]))
    cpu_rope = drive(python, [{"model": src}], tmp_path_factory.mktemp("rope"), site)
    out["float_cpu_rope"] = cpu_rope["runs"][0]
    out["probe"] = tmp / "fak.pt"
    return out


#: What each refusal's one line names.
BAD = {
    "bad_fa_k": "model.layers.1.self_attn",
    "block16": "multiple of 32",
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_mla_input_stops_at_start_up_in_one_line(mla_engine, name):
    refused = mla_engine[name].get("refused")
    assert refused is not None, f"{name}: the engine started"
    lines = [line for line in refused.splitlines() if BAD[name] in line]
    assert len(lines) == 1, refused


def _served(run: dict) -> dict:
    """``run``, which must have served; on a CPU without AMX vLLM forces block
    size 16 for every MLA model, which the plugin refuses: the test skips there
    with that line (``test_bad_mla_input_stops_at_start_up_in_one_line`` checks
    the refusal itself)."""
    refused = run.get("refused")
    if refused is not None and BAD["block16"] in refused:
        pytest.skip(f"vLLM chose block size 16 on this CPU: {refused[-300:]}")
    assert refused is None, refused
    return run


def _rows(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """Log-softmax rows of one causal forward over the prompt and the generated
    tokens: row ``i`` predicts token ``i + 1`` (the prefill and decode positions
    vLLM reports; static scales make them independent of how the steps split)."""
    with torch.no_grad():
        ids = torch.tensor([prompt + gen[:-1]])
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _max_diff(run: dict, model) -> float:
    worst = 0.0
    for prompt, out in zip(_prompts(), run["outputs"]):
        rows = _rows(model, prompt, out["tokens"])
        entries = out["prompt_logprobs"][1:] + out["logprobs"]
        assert len(entries) == rows.shape[0]
        for i, entry in enumerate(entries):
            for tok, lp in entry.items():
                worst = max(worst, abs(lp - float(rows[i, int(tok)])))
    return worst


def _load_hf(src: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.bfloat16
    ).eval()


def test_bf16_noise_mla(mla_engine, mla_artifacts):
    model = _load_hf(mla_artifacts["src"])
    noise = _max_diff(mla_engine["float"], model)
    cpu_rope = _max_diff(mla_engine["float_cpu_rope"], model)
    print(f"\nbf16 noise (vLLM vs transformers, DeepSeek float source): {noise:.4f}; "
          f"with vLLM's CPU rotary kernel: {cpu_rope:.4f}")  # fmt: skip
    assert noise <= BF16_NOISE_BOUND, f"bf16 noise {noise:.4f}"


@pytest.mark.parametrize("name", ["fak", "fak_va"])
def test_plugin_matches_eval_fakquant(mla_engine, mla_artifacts, name):
    """vLLM with the plugin vs ``ascend-fa eval``'s fake-quant of the artifact
    (its FA points with the artifact's scales, on its quantized linears; eval's
    dynamic per-token point for the query of the vllm-ascend artifact)."""
    from ascend_fa.adapters.hf import swapped_points
    from ascend_fa.calibration import FA3FakeQuant
    from ascend_fa.calibration.pipeline import injected_points
    from ascend_fa.evaluation import DynamicFakeQuant, read_artifact_scales
    from ascend_fa.linear.io import artifact_model

    run = _served(mla_engine[name])
    art = mla_artifacts[name]
    model = artifact_model(_load_hf(mla_artifacts["src"]), art)
    scales = read_artifact_scales(art)

    def make(attn: str, branch: str, point):
        if name == "fak_va" and branch == "fa_q":
            return DynamicFakeQuant(branch, point.num_heads, point.head_dim)
        scale, offset = scales[attn][branch]
        return FA3FakeQuant(branch, scale.reshape(-1), offset.reshape(-1),
                            getattr(point, "head_dim", None))  # fmt: skip

    with injected_points(model) as (_, mods), swapped_points(mods, make):
        worst = _max_diff(run, model)
    print(f"\n{name}: plugin vs eval, max |logprob| difference {worst:.4f}")
    assert worst <= LOGPROB_BOUND, f"plugin vs eval {worst:.4f}"


def _naive_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Each element's code, one at a time: fp32 divide, round half to even
    (Python's ``round``), saturate to [-128, 127]."""
    out = torch.empty(x.shape, dtype=torch.int8)
    s = torch.tensor(scale, dtype=torch.float32)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = float(x[i, j].float() / s)
            out[i, j] = max(-128, min(127, round(v)))
    return out


def test_latent_codes_bit_exact(mla_engine):
    from ascend_fa.attention import reshape_and_cache_mla

    _served(mla_engine["fak"])
    p = torch.load(mla_engine["probe"])
    latent, rope, slots = p["latent"], p["rope"], p["slots"]
    k_scale = p["scales"]["k"]
    t, r = latent.shape
    bs = 32
    nb = int(slots.max()) // bs + 1
    lc = torch.zeros(nb, bs, 1, r, dtype=torch.int8)
    rc = torch.zeros(nb, bs, 1, rope.shape[1], dtype=rope.dtype)
    reshape_and_cache_mla(latent, rope, lc, rc, slots.long(), k_scale=k_scale,
                          layout="nd")  # fmt: skip
    ours = lc.reshape(-1, r)[slots.long()]
    assert p["codes"].dtype == torch.int8
    assert torch.equal(p["codes"], ours)
    assert torch.equal(p["codes"], _naive_codes(latent, float(k_scale)))
    assert torch.equal(p["rope_cached"], rope)
    assert int(p["codes"].abs().max()) > 64  # the scale is the calibrated one


def test_mla_nz_cache_layout_gives_the_same_outputs(mla_engine):
    nz = _served(mla_engine["fak_nz"])
    assert nz["outputs"] == _served(mla_engine["fak"])["outputs"]
