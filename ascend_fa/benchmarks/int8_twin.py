"""The peer of ``bench serving``: a compressed-tensors W8A8 twin of a float model,
which vLLM serves on its own int8 path (oneDNN's int8 GEMM on the CPU).

The twin is the source directory with every decoder-layer linear (a 2-D
``...layers.<i>....<name>_proj.weight``) replaced by int8 codes, symmetric per
output channel (``weight`` int8 ``[N, K]``, ``weight_scale`` fp32 ``[N, 1]``,
``scale = max|W_n| / 127``: :func:`~ascend_fa.linear.modules.quantize_weight`), and
``config.json``'s ``quantization_config`` saying so, with activations quantized per
token at run time (symmetric int8, ``dynamic``). Everything else (embeddings,
norms, ``lm_head``) stays as the source has it.

What vLLM 0.32 reads (vllm-project/vllm
``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py``
``from_config`` / ``_get_scheme_from_parts``, and ``schemes/
compressed_tensors_w8a8_int8.py``): ``quant_method`` ``"compressed-tensors"``,
``format`` ``"int-quantized"`` (an activation-quantization format), one config group
targeting ``Linear`` with 8-bit int weights of strategy ``channel`` (not dynamic)
and 8-bit int input activations of strategy ``token``, ``dynamic`` and symmetric --
:class:`CompressedTensorsW8A8Int8` with a dynamic per-token input, whose
parameters are ``weight`` int8 ``[N, K]`` and ``weight_scale`` fp32 ``[N, 1]``;
``ignore`` names the modules left float (``lm_head``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from ascend_fa.errors import InputError
from ascend_fa.linear.modules import quantize_weight
from ascend_fa.safe_files import read_json_object

__all__ = ["TWIN_QUANTIZATION_CONFIG", "is_twin_linear", "write_int8_twin"]

#: ``config.json``'s ``quantization_config`` of the twin.
TWIN_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
                "group_size": None,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
                "group_size": None,
            },
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
}

_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(.+\.)?[A-Za-z0-9_]*proj\.weight$")


def is_twin_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the twin quantizes the tensor ``name``: a 2-D weight of a decoder
    layer's ``*proj`` linear."""
    return len(shape) == 2 and _LINEAR.search(name) is not None


def _weight_files(source: Path) -> list[Path]:
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputError(f"{index}: no weight_map")
        return [source / f for f in sorted(set(weight_map.values()))]
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise InputError(f"{source}: no *.safetensors weights for the vLLM int8 twin")
    return files


def write_int8_twin(source: str | Path, out: str | Path) -> int:
    """Write the compressed-tensors W8A8 twin of the float model ``source`` to the
    new directory ``out``; returns how many linears it quantized. Refuses a source
    that already carries a ``quantization_config`` or holds routed experts (vLLM
    serves compressed-tensors experts through another scheme); nothing stays in
    ``out`` then."""
    source, out = Path(source), Path(out)
    config = read_json_object(source / "config.json")
    if "quantization_config" in config:
        raise InputError(
            f"{source / 'config.json'}: already has a quantization_config; the "
            "vLLM int8 twin is made from the float source"
        )
    out.mkdir(parents=True)
    try:
        return _write(source, out, config)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written stays
        raise


def _write(source: Path, out: Path, config: dict) -> int:
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            if not f.name.startswith("model.safetensors.index"):
                shutil.copyfile(f, out / f.name)
    count = 0
    weight_map: dict[str, str] = {}
    for path in _weight_files(source):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = fh.get_tensor(name)
                if ".experts." in name:
                    raise InputError(
                        f"{path.name}: {name}: routed experts; the vLLM int8 twin "
                        "covers dense models only"
                    )
                if is_twin_linear(name, tuple(t.shape)):
                    codes, scale = quantize_weight(t, torch.float32)
                    tensors[name] = codes
                    tensors[name[: -len("weight")] + "weight_scale"] = scale[:, None]
                    count += 1
                else:
                    tensors[name] = t.contiguous()
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    if (source / "model.safetensors.index.json").is_file():
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if count == 0:
        raise InputError(f"{source}: no decoder-layer *proj linears to quantize")
    config["quantization_config"] = TWIN_QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return count
