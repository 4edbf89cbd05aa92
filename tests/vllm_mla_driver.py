"""Runs the real vLLM on MLA models (``tests/vllm_serving_driver.py``'s engine
runs) and records the FAKQuant cache of the first MLA layer. Run by
``tests/test_vllm_serving_mla.py`` with the python of the vLLM environment.

    python tests/vllm_mla_driver.py REQUEST.json

REQUEST and output as ``vllm_serving_driver.py``'s; a run's ``mla_probe`` PATH
(plugin runs) gets, for the first MLA layer, the latent and ``k_pe`` its first
cache write received with the slots, the int8 latent codes and the RoPE values
the cache holds at those slots after generation, and the layer's scales.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_serving_driver import _cpu, run_engine  # noqa: E402


class MLAProbe:
    """Patches the plugin's MLA impl (in this process only) to keep its first
    cache write."""

    def __init__(self):
        from ascend_fa.serving import mla

        self.write = None
        self.impl = None
        cls = mla.AscendMLAImpl
        orig = cls.do_kv_cache_update
        probe = self

        def do_kv_cache_update(self_, kv_c, k_pe, kv_cache, slots, dtype, k_scale):
            if probe.write is None and kv_cache.numel():
                n = slots.shape[0]
                probe.write = {"latent": kv_c[:n].clone(),
                               "rope": k_pe[:n].reshape(n, -1).clone(),
                               "slots": slots.clone()}  # fmt: skip
                probe.impl = self_
                probe.cache = kv_cache
            return orig(self_, kv_c, k_pe, kv_cache, slots, dtype, k_scale)

        cls.do_kv_cache_update = do_kv_cache_update
        self.restore = lambda: setattr(cls, "do_kv_cache_update", orig)

    def save(self, path: str) -> None:
        import torch

        impl = self.impl
        lat, rope = impl._views(self.cache)
        assert impl.ascend_layout == "nd"
        slots = self.write["slots"].long()
        torch.save({
            **self.write, "scales": impl.ascend_scales,
            "codes": lat.reshape(-1, lat.shape[-1])[slots].clone(),
            "rope_cached": rope.reshape(-1, rope.shape[-1])[slots].clone(),
            "cache_dtype": str(self.cache.dtype), "layer": impl.ascend_layer.layer_name,
        }, path)  # fmt: skip


def main() -> None:
    with open(sys.argv[1]) as f:
        req = json.load(f)
    runs = []
    for run in req["runs"]:
        probe = MLAProbe() if run.get("mla_probe") else None
        try:
            out = run_engine(req, run)
            if probe is not None and "refused" not in out:
                probe.save(run["mla_probe"])
        finally:
            if probe is not None:
                probe.restore()
        runs.append(out)
    print(json.dumps({"cpu": _cpu(), "runs": runs}))


if __name__ == "__main__":
    main()
