"""Runs MindIE-LLM's own model construction on artifact directories (a CPU, no CANN).

    python tests/mindie_own_driver.py SRC OUT.json ARTIFACT_DIR...

SRC is a MindIE-LLM source tree (github Ascend/MindIE-LLM; the harness pins the
commit). Its ``examples/atb_models`` (``atb_llm``) and its root (``mindie_llm``) go
on ``sys.path`` behind the stand-ins of ``tests/mindie_stub`` (``torch_npu``,
``acl``, the ATB torch library). For each artifact the driver does what MindIE's
``ModelRunner`` does for one rank on one device (``atb_llm/runner/model_runner.py``
L217-L305 ``__init__``, L405-L600 ``load_weights`` / ``init_model``, C++ graph, no
preallocation): ``initialize_distributed``, ``get_model`` (the router: config.json
and quant_model_description.json), ``router.model_cls`` / ``router.config``, the
runner's dtype check, ``Mapping``, ``Weights(...)``, and the model class called with
the runner's keyword arguments, to the end of its ``__init__``.

Per artifact it writes to OUT.json:

* ``verdict``: ``loads`` (the model built, and every quantized tensor of the file
  is held by a buffer or parameter of the module MindIE built, as MindIE's own
  transforms leave it), ``silent`` (built, but some quantized tensor is held
  nowhere, or an ``fa_*`` tensor was never read), or ``error``;
* ``error``: the exception (type and message) and the MindIE frame that raised it;
* ``asked``: every tensor name the model asked ``Weights`` for (found or not), in
  order; ``missing``: those asked and absent (each a lookup MindIE caught or the
  one it died on); ``unheld``: quantized file tensors the module does not hold;
  ``fa_unread``: ``fa_*`` tensors never asked for;
* ``quantize`` / ``fa_quant_type`` / ``model_cls``: what the router decided;
* ``atb``: the ATB graphs the model created (the stand-in library's record).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUB = HERE / "mindie_stub"

#: A linear's tensors MindIE reads per its described type (atb_llm
#: ``utils/weights.py`` L758-770 w8a8: weight, deq_scale, quant_bias, input_scale,
#: input_offset; L773-799 w8a8_dynamic: weight, weight_scale, weight_offset). A
#: static W8A8 linear's weight_scale / weight_offset (msModelSlim's format carries
#: them for other consumers) are folded into its deq_scale, which is what MindIE
#: reads: they are not checked.
LINEAR_TENSORS = {
    "W8A8": ("weight", "deq_scale", "quant_bias", "input_scale", "input_offset"),
    "W8A8_DYNAMIC": ("weight", "weight_scale", "weight_offset"),
}
#: file tensor suffix -> the buffer / parameter names MindIE keeps it under
#: (``quantize/w8a8.py`` W8A8LinearStatic, ``quantize/w8a8_dynamic.py``
#: W8A8LinearDynamic, ``layers/attention/fa3.py`` FA3, ``kv_cache.py`` KvCache)
HELD_AS = {
    "weight": ("weight",),
    "deq_scale": ("deq_scale",),
    "quant_bias": ("quant_bias",),
    "input_scale": ("input_scale",),
    "input_offset": ("input_offset",),
    "weight_scale": ("weight_scale",),
    "weight_offset": ("weight_offset",),
    "fa_q.scale": ("q_scale",),
    "fa_k.scale": ("k_scale",),
    "fa_v.scale": ("v_scale",),
    "fa_q.offset": ("q_offset",),
    "fa_k.offset": ("kv_offset",),
    "fa_v.offset": ("kv_offset",),
    "kv_cache_scale": ("k_quant_scale", "v_quant_scale"),
    "kv_cache_offset": ("k_quant_offset", "v_quant_offset"),
}


def _environment(src: Path, scratch: Path) -> None:
    """What MindIE's environment module needs at import (``mindie_llm/utils/env.py``
    L146-151: an absolute benchmark path; ``atb_llm/utils/env.py`` L34: no CPU
    binding (no npu-smi here); L67: ``ATB_SPEED_HOME_PATH``, where the stand-in
    library is loaded from)."""
    os.environ["MINDIE_LLM_BENCHMARK_FILEPATH"] = str(scratch / "benchmark.jsonl")
    os.environ["BIND_CPU"] = "0"
    os.environ["ATB_SPEED_HOME_PATH"] = str(scratch / "atb_speed")
    # the npu-smi stand-in (one device; utils/initial.py is_support_hccs)
    os.environ["PATH"] = f"{STUB / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["NPU_SMI_STAND_IN_LOG"] = str(scratch / "npu-smi.log")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    sys.path[:0] = [str(STUB), str(src / "examples" / "atb_models"), str(src)]


def _file_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _checked(files: dict, desc: dict) -> dict[str, str]:
    """The quantized file tensors whose values MindIE must hold: name -> kind (a
    key of :data:`HELD_AS`): each int8 linear's tensors for its described type
    (:data:`LINEAR_TENSORS`), every ``fa_*`` tensor, every KV-cache scale."""
    import torch

    out: dict[str, str] = {}
    for name, t in files.items():
        if ".fa_" in name:
            out[name] = "fa_" + name.split(".fa_")[1]
        elif name.endswith((".kv_cache_scale", ".kv_cache_offset")):
            out[name] = name.rsplit(".", 1)[1]
        elif name.endswith(".weight") and t.dtype == torch.int8:
            prefix = name.removesuffix(".weight")
            for suffix in LINEAR_TENSORS.get(str(desc.get(name)), ("weight",)):
                if f"{prefix}.{suffix}" in files:
                    out[f"{prefix}.{suffix}"] = suffix
    return out


def _rows(t):
    """A tensor as rows: ``[out, ...]`` -> ``[out, prod(rest)]``; 0-d -> ``[1, 1]``."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(t.shape[0], -1)


def _contains(m, f) -> bool:
    """Whether ``f`` (already in ``m``'s dtype) is a block of rows of ``m`` (as
    MindIE packs q/k/v or gate/up by concatenation and stacks experts), broadcast
    along the columns where ``f`` has one (FA3 repeats a per-head scale over
    head_dim)."""
    import torch

    f2 = _rows(f)
    m2 = m.reshape(-1, m.shape[-1]) if m.dim() > 1 else m.reshape(-1, 1)
    if f2.shape[1] == 1 and m2.shape[1] != 1:
        f2 = f2.expand(f2.shape[0], m2.shape[1])
    if f2.shape[1] != m2.shape[1] or f2.shape[0] > m2.shape[0]:
        return False
    n = f2.shape[0]
    for r in range(m2.shape[0] - n + 1):
        if torch.equal(m2[r : r + n], f2):
            return True
    # MLA permutes the RoPE rows of q_proj / kv_a_proj_with_mqa
    # (utils/layers/attention/process_mla_linear.py): every row of f, as a
    # multiset, among m's rows
    from collections import Counter

    have = Counter(bytes(r.contiguous().view(torch.uint8).numpy()) for r in m2)
    want = Counter(bytes(r.contiguous().view(torch.uint8).numpy()) for r in f2)
    return all(have[k] >= v for k, v in want.items())


def _held(kind: str, name: str, f, module_tensors: dict, dtype) -> bool:
    """Whether the module MindIE built holds the file tensor ``f`` (``name``): a
    buffer or parameter of the same layer, named as MindIE names it
    (:data:`HELD_AS`), equal to ``f`` as MindIE's loader leaves it: cast to the
    buffer's dtype (``Weights.correct_tensor_dtype`` casts float tensors to the
    model dtype), transposed (``check_transpose``), negated (W8A8_DYNAMIC
    ``weight_offset``), inverted (``FA3.load_mla``'s ``1 / q_scale``)."""

    layer = _layer_index(name)
    for mname, m in module_tensors.items():
        if mname.split(".")[-1] not in HELD_AS[kind]:
            continue
        # the same decoder layer (MindIE names it model.layers.N or transformer.h.N)
        if layer is not None and _layer_index(mname) != layer:
            continue
        if m.dim() == 0 or m.numel() == 0:
            continue
        cands = [f]
        if f.dim() == 2:
            cands.append(f.transpose(0, 1))
        if kind.endswith("offset"):
            cands.append(-f)
        if kind == "fa_q.scale":
            cands.append(1.0 / f.to(dtype))
        for c in cands:
            c = c.to(m.dtype)
            if _contains(m, c) or (m.dim() == 2 and _contains(m.transpose(0, 1), c)):
                return True
    return False


def _layer_index(name: str) -> str | None:
    """The decoder layer a dotted name is in: its first all-digit part."""
    return next((p for p in name.split(".") if p.isdigit()), None)


def _module_tensors(model) -> dict:
    out = {}
    for n, t in model.named_parameters():
        out[n] = t.detach()
    for n, t in model.named_buffers():
        out[n] = t.detach()
    return out


def _frame(exc: BaseException, src: Path) -> str:
    """The innermost frame of MindIE's source that the exception passed."""
    where = ""
    for fs in traceback.extract_tb(exc.__traceback__):
        if fs.filename.startswith(str(src)):
            where = f"{Path(fs.filename).relative_to(src)}:{fs.lineno}"
    return where


def run_one(path: Path, src: Path) -> dict:
    import atb_speed_torch
    import torch
    import torch_npu
    from atb_llm.models import get_model
    from atb_llm.utils.dist import initialize_distributed
    from atb_llm.utils.mapping import Mapping
    from atb_llm.utils.weights import Weights

    asked: list[str] = []
    missing: list[str] = []
    original = Weights.get_filename

    def get_filename(self, tensor_name: str):
        if tensor_name not in asked:
            asked.append(tensor_name)
        try:
            return original(self, tensor_name)
        except AssertionError:
            missing.append(tensor_name)
            raise

    Weights.get_filename = get_filename
    atb_speed_torch.CREATED.clear()
    rec: dict = {"artifact": path.name}
    try:
        with torch_npu.HostDevice():
            # runner/model_runner.py L217: one rank, device npu:0
            process_group, device = initialize_distributed(0, 0, 1)
            router = get_model(
                str(path),
                is_flash_causal_lm=True,
                load_tokenizer=False,
                max_position_embeddings=None,
                revision=None,
                tokenizer_path=None,
                trust_remote_code=False,
                enable_atb_torch=False,
                enable_edge=False,
                llm_config_path=None,
                models_dict=None,
                sub_model_path="part0-of-1",
            )
            model_cls = router.model_cls
            config = router.config
            rec["model_cls"] = model_cls.__name__
            rec["quantize"] = config.quantize
            qc = config.quantization_config
            rec["fa_quant_type"] = getattr(qc, "fa_quant_type", None)
            dtype = config.torch_dtype
            # model_runner.py L297-305: fp16 / bf16 only
            if dtype not in (torch.float16, torch.bfloat16):
                raise NotImplementedError(
                    "`torch_dtype` is only supported for type `float16` and `bfloat16`"
                )
            is_gqa = (
                hasattr(config, "num_key_value_heads")
                and hasattr(config, "num_attention_heads")
                and config.num_attention_heads != config.num_key_value_heads
            )
            mapping = Mapping(world_size=1, rank=0, llm_config=router.llm_config)
            weights = Weights(
                str(path),
                device,
                dtype,
                process_group=process_group,
                quantize=config.quantize,
                is_gqa=is_gqa,
                extension=".safetensors",
                mapping=mapping,
                lazy_loading_file_handlers=False,
            )
            # model_runner.py L585-599 init_model (a fresh runner's kwargs; the
            # server passes num_speculative_tokens, 0 without speculation:
            # mindie_llm/runtime/config/mindie_llm_config.py L51)
            model = model_cls(
                config,
                weights,
                inference_mode=None,
                plugin_params=None,
                trust_remote_code=False,
                lora_model_config=None,
                lora_adapter=None,
                num_speculative_tokens=0,
                distributed_enable=False,
                max_batch_size=-1,
                llm_config=router.llm_config,
                model_role="standard",
                mempool_type=0,
            )
    except Exception as exc:  # noqa: BLE001 - MindIE's own error is the verdict
        rec.update(
            verdict="error",
            error=f"{type(exc).__name__}: {exc}".splitlines()[0][:400],
            frame=_frame(exc, src),
        )
        model = None
    finally:
        Weights.get_filename = original
    rec["asked"] = asked
    rec["missing"] = missing
    rec["atb"] = [
        {"class": c["class"], "name": c["name"], "params": len(c["params"])}
        for c in atb_speed_torch.CREATED
    ]
    files = _file_tensors(path)
    # an attention whose fa_* tensors MindIE never reads (MLA's FA3.load_mla reads
    # fa_q.scale and fa_k.scale: the latent is K and V; the offsets and fa_v of
    # msModelSlim's format ride along, fa3.py load_mla)
    read = {n.split(".fa_")[0] for n in asked if ".fa_" in n}
    rec["fa_unread"] = sorted(
        n for n in files if ".fa_" in n and n.split(".fa_")[0] not in read
    )
    rec["fa_read"] = sorted(n for n in files if ".fa_" in n and n in asked)
    if model is None:
        return rec
    held = _module_tensors(model)
    dtype = weights.dtype
    dfile = path / "quant_model_description.json"
    desc = json.loads(dfile.read_text()) if dfile.is_file() else {}
    unheld = []
    for name, kind in _checked(files, desc).items():
        if name.split(".")[-2].startswith("fa_") and name not in asked:
            continue  # an fa_* tensor MindIE does not read (see fa_unread)
        if not _held(kind, name, files[name], held, dtype):
            unheld.append(name)
    rec["unheld"] = sorted(unheld)
    rec["verdict"] = "silent" if unheld or rec["fa_unread"] else "loads"
    return rec


def main(argv: list[str]) -> int:
    src = Path(argv[0]).resolve()
    out = Path(argv[1])
    scratch = Path(tempfile.mkdtemp(prefix="mindie-own-"))
    (scratch / "atb_speed" / "lib").mkdir(parents=True)
    _environment(src, scratch)
    import atb_speed_torch
    import torch_npu  # noqa: F401 - the stand-in, before atb_llm imports it

    atb_speed_torch.install(src, scratch / "atb_speed")
    results = [run_one(Path(a).resolve(), src) for a in argv[2:]]
    log = scratch / "npu-smi.log"
    smi = sorted(set(log.read_text().splitlines())) if log.is_file() else []
    out.write_text(
        json.dumps({"results": results, "touched": torch_npu.TOUCHED, "npu_smi": smi})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
