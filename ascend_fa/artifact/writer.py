"""Write artifacts atomically for a target, and merge into an msModelSlim export.

The layout and every name come from :mod:`.format`, what each consumer loads from
:mod:`.targets`. Checkpoint tensors (:func:`checkpoint_tensors`): the model's
tensors under the names its checkpoint uses (transformers' own
``revert_weight_conversion``, so fused in-memory MoE experts are written as
``mlp.experts.{e}.{gate,up,down}_proj.weight``); a quantized linear (a module with
``export_tensors``, see the ``QuantizedLinear`` protocol) contributes exactly the
tensors it exports, typed with its ``quant_type``. Tied weights: for the Ascend
targets the tied ``lm_head.weight`` is written as its own copy and described, as
msModelSlim's saver does (it walks every module's parameters); for ``vllm`` and
research artifacts it is left out, exactly as ``save_pretrained`` does. Any other
tensor sharing storage is written as its own copy (safetensors refuses aliases).

``config.json`` is the source's, kept key for key (:mod:`.model_files`); it never
carries ``quantization_config`` for the Ascend targets (nor for research
artifacts) and always carries ``torch_dtype``; ``vllm`` artifacts carry the
compressed-tensors ``quantization_config`` instead of a description. The source's
other model files are copied as msModelSlim copies them.

Every write is atomic: files go to a temporary directory beside the output, which
is renamed over it at the end; on any error the temporary directory is removed and
an existing output is left as it was.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ascend_fa.errors import (
    FileFormatError,
    UnsupportedError,
)
from ascend_fa.families import reads_fa
from ascend_fa.safe_files import DuplicateKeyError, unique_keys

from .format import (
    CONFIG_FILE,
    DESCRIPTION_FILE,
    DESCRIPTION_VERSION,
    FA_BRANCHES,
    FA_QUANT_TYPES,
    FA_WEIGHTS_NAME,
    LINEAR_QUANT_TYPES,
    REPORT_FILE,
    TARGET_METADATA_KEY,
    TOKENIZER_FILES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    ScaleMap,
    disk_scale,
    fa_tensor_name,
    mixed_moe_linears,
)
from .lazy import LazyTensors, write_safetensors
from .mindie_models import (
    mindie_attention_biases,
    mindie_config,
    mindie_required_keys,
)
from .model_files import (
    copy_model_files,
    merged_config,
    read_source_config,
    target_config,
)
from .output import atomic_output_dir
from .reader import read_tensor_index
from .targets import (
    KVScaleMap,
    c8_tensors,
    check_target,
    target_description,
    vllm_kv_tensors,
)

__all__ = [
    "parse_size",
    "fa_tensors",
    "build_description",
    "checkpoint_state_dict",
    "checkpoint_tensors",
    "CheckpointTensors",
    "hf_checkpoint_names",
    "linear_quant_type",
    "export_artifact",
    "merge_into",
    "write_json",
    "write_extra_files",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``/``500MiB``/``1024`` (decimal as in HF; ``iB`` binary)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"shard size must be > 0 bytes, got {size}")
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"cannot parse size {size!r}; use e.g. 5GB, 500MB, 2GiB")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if value <= 0:
        raise ValueError(f"shard size must be > 0 bytes, got {size!r}")
    return value


def fa_tensors(scales: ScaleMap) -> dict[str, torch.Tensor]:
    """Artifact tensors for ``scales``: ``<attn>.fa_x.scale`` fp32 ``[H, 1]`` and
    ``<attn>.fa_x.offset`` int8 ``[H, 1]`` (zeros: the kernels are symmetric)."""
    out: dict[str, torch.Tensor] = {}
    for attn in sorted(scales):
        branches = scales[attn]
        missing = [b for b in FA_BRANCHES if b not in branches]
        if missing:
            raise ValueError(f"{attn}: missing FA branches {missing}")
        for branch in FA_BRANCHES:
            scale, offset = branches[branch]
            name = fa_tensor_name(attn, branch, "scale")
            scale = disk_scale(scale, name)
            offset = offset.detach().to("cpu").reshape(-1, 1)
            if offset.shape != scale.shape or bool((offset != 0).any()):
                raise ValueError(
                    f"{attn}.{branch}.offset must be zeros shaped like "
                    f"the scale {tuple(scale.shape)}"
                )
            out[name] = scale
            out[fa_tensor_name(attn, branch, "offset")] = torch.zeros_like(
                scale, dtype=torch.int8
            )
    return out


def build_description(
    weight_names: list[str],
    scales: ScaleMap,
    fa_quant_type: str,
    *,
    model_quant_type: str = "FLOAT",
) -> dict[str, str]:
    """The description of a FLOAT checkpoint plus FA tensors (see module doc)."""
    if fa_quant_type not in FA_QUANT_TYPES:
        raise ValueError(
            f"fa_quant_type must be FAQuant or FAKQuant, got {fa_quant_type!r}"
        )
    desc: dict[str, str] = {
        "model_quant_type": model_quant_type,
        "fa_quant_type": fa_quant_type,
        "version": DESCRIPTION_VERSION,
    }
    desc.update(dict.fromkeys(weight_names, "FLOAT"))
    for attn in sorted(scales):
        desc[f"{attn}.quant_type"] = "INT8"
        for branch in FA_BRANCHES:
            for kind in ("scale", "offset"):
                desc[fa_tensor_name(attn, branch, kind)] = "FAQuant"
    return desc


@dataclass
class CheckpointTensors:
    """A model's checkpoint tensors, each tensor's description type, and the
    linears' type (``model_quant_type``)."""

    tensors: dict[str, torch.Tensor]
    types: dict[str, str]
    model_quant_type: str


def linear_quant_type(types: Mapping[str, str] | list[str]) -> str:
    """The description's ``model_quant_type`` for the types of the tensors written:
    ``"W8A8"`` when any linear is static W8A8 (msModelSlim ranks W8A8 above
    W8A8_DYNAMIC: msmodelslim 26.1.0 modelslim_v1/save/ascendv1.py
    ``QUANT_TYPE_PRIORITY``), else ``"W8A8_DYNAMIC"`` when any is, else
    ``"FLOAT"``."""
    values = set(types.values() if isinstance(types, Mapping) else types)
    for t in ("W8A8", "W8A8_DYNAMIC"):
        if t in values:
            return t
    return "FLOAT"


def hf_checkpoint_names(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """transformers' own mapping from in-memory names back to checkpoint names (what
    ``save_pretrained`` writes), when this transformers has one."""
    from ascend_fa.hf_compat import revert_to_checkpoint_names

    return revert_to_checkpoint_names(model, tensors)


def checkpoint_tensors(
    model: torch.nn.Module,
    dtype: torch.dtype | None = None,
    *,
    tied_copies: bool = False,
    keep: Callable[[str], bool] | None = None,
    part: torch.nn.Module | None = None,
    part_prefix: str = "",
) -> CheckpointTensors:
    """The model's tensors under their checkpoint names, ready for safetensors.

    A module with ``export_tensors`` (a quantized linear) contributes
    ``export_tensors(name)`` as returned (no cast), typed with its ``quant_type``;
    its own state_dict entries are not written. Every other tensor: anything under
    an ``fa_q``/``fa_k``/``fa_v`` submodule and non-persistent buffers are dropped,
    floating tensors are cast to ``dtype``, names go through transformers'
    checkpoint mapping (fused MoE experts are split per expert), and each is typed
    ``"FLOAT"``. Tied copies (``model.all_tied_weights_keys``) are dropped, or
    written as their own copy with ``tied_copies``. ``keep(name)`` limits it to
    the state_dict entries and quantized modules it accepts (a streaming export
    takes one decoder layer at a time). ``part`` (with ``part_prefix``, its name
    in ``model`` plus ``"."``): read the state and modules of this submodule only
    (a streamed layer: the same result as ``keep`` for that prefix, without a
    whole-model walk per layer).
    """
    if part is not None:
        named = [(part_prefix + n, m) for n, m in part.named_modules() if n]
        state = {part_prefix + k: v for k, v in part.state_dict().items()}
    else:
        named = list(model.named_modules())
        state = model.state_dict()
    quantized = {
        name: m
        for name, m in named
        if name
        and callable(getattr(m, "export_tensors", None))
        and (keep is None or keep(name + "."))
    }
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    floats: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in state.items():
        if keep is not None and not keep(name):
            continue
        if any(f".{b}." in f".{name}" for b in FA_BRANCHES):
            continue
        if any(name.startswith(q + ".") for q in quantized):
            continue
        if name in tied and not tied_copies:
            continue
        t = t.detach()
        if not t.is_meta:  # a meta tensor (a streamed layer's specs) stays meta
            t = t.to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.untyped_storage().data_ptr() and key in seen:
            t = t.clone()
        seen.add(key)
        floats[name] = t.contiguous()
    tensors = hf_checkpoint_names(model, floats)
    types = dict.fromkeys(tensors, "FLOAT")
    for qname, module in quantized.items():
        quant_type = str(getattr(module, "quant_type", ""))
        if quant_type not in LINEAR_QUANT_TYPES:
            raise ValueError(
                f"{qname}: quant_type {quant_type!r}; expected one of "
                f"{', '.join(LINEAR_QUANT_TYPES)}"
            )
        for tname, t in module.export_tensors(qname).items():
            if tname in tensors:
                raise ValueError(f"{tname}: exported twice")
            tensors[tname] = t.detach().to("cpu").contiguous()
            types[tname] = quant_type
    return CheckpointTensors(tensors, types, linear_quant_type(types))


def checkpoint_state_dict(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of :func:`checkpoint_tensors` (tied copies dropped)."""
    return checkpoint_tensors(model, dtype).tensors


def write_json(path: Path, obj: Any) -> None:
    path.write_text(
        json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def write_extra_files(directory: Path, files: Mapping[str, bytes] | None) -> None:
    """Write ``files`` (plain file name -> bytes, e.g. the picture report) into
    ``directory``; a name with a path separator is refused."""
    for name, data in (files or {}).items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"extra file name must be a plain file name: {name!r}")
        (directory / name).write_bytes(data)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_shards(
    directory: Path, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int
) -> list[str]:
    """Greedy shards in insertion order; one file -> no index. Returns file names.
    A :class:`LazyTensors` is written one tensor at a time (same shards)."""
    lazy = isinstance(tensors, LazyTensors)
    sizes = {
        name: tensors.nbytes(name) if lazy else _nbytes(t)
        for name, t in (((n, None) for n in tensors) if lazy else tensors.items())
    }
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    metadata = {"format": "pt"}

    def write(names: list[str], path: Path) -> None:
        if lazy:
            write_safetensors(path, tensors, names, metadata)
        else:
            save_file({k: tensors[k] for k in names}, str(path), metadata=metadata)

    if len(shards) == 1:
        write(shards[0], directory / WEIGHTS_NAME)
        return [WEIGHTS_NAME]
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    files, weight_map = [], {}
    for i, names in enumerate(shards, start=1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        write(names, directory / fname)
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(sizes.values())
    write_json(
        directory / WEIGHTS_INDEX_NAME,
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    return files


def _model_geometry(config: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """``(H, Hkv, D)`` from a model config dict (GQA layout)."""
    if config is None:
        raise ValueError("the model config is needed to size KV-cache scales")
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads, kv, dim


def export_artifact(
    output: str | Path,
    *,
    state_dict: Mapping[str, torch.Tensor],
    scales: ScaleMap | None = None,
    fa_quant_type: str | None = None,
    config: Mapping[str, Any] | None = None,
    source_dir: str | Path | None = None,
    tokenizer: Any = None,
    report: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    force: bool = False,
    target: str | None = None,
    tensor_types: Mapping[str, str] | None = None,
    kv_scales: KVScaleMap | None = None,
    kv_strategy: str = "tensor",
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a complete artifact for ``target`` to ``output`` atomically; return it.

    ``state_dict`` are the checkpoint tensors and ``tensor_types`` their description
    types (:func:`checkpoint_tensors`; default: all ``"FLOAT"``). ``target``:

    * ``None`` — a research artifact: float weights + FA tensors (``scales``);
    * ``"mindie"`` — FA tensors next to quantized linears;
    * ``"vllm-ascend"`` — C8 from ``kv_scales`` (``[Hkv*D]`` per layer, GQA) or, for
      MLA, FAKQuant ``scales`` next to quantized linears;
    * ``"vllm"`` — ``kv_scales`` as ``<attn>.{k,v}_scale`` (``kv_strategy``), no
      description, compressed-tensors ``quantization_config``.

    ``config.json`` (:func:`~.model_files.artifact_config`): ``source_dir``'s
    config.json kept when it has one, else ``config`` (the loaded model's config
    as a dict, a GGUF source) with transformers 4's RoPE keys; ``dtype`` is its
    ``torch_dtype`` (default: the dtype of the floating weights). ``config`` also
    sizes the KV-cache scales. ``metadata`` goes into the description's
    ``metadata`` (e.g. the folded transforms). The source's other model files
    (tokenizer, generation config, chat template ...) are copied from
    ``source_dir`` as msModelSlim copies them
    (:func:`~.model_files.copy_model_files`); without tokenizer files among them
    the tokenizer is saved from ``tokenizer``.
    """
    types = dict(tensor_types) if tensor_types is not None else {}
    types = {name: types.get(name, "FLOAT") for name in state_dict}
    model_quant_type = linear_quant_type(types)
    if dtype is None:
        floats = [t.dtype for t in state_dict.values() if t.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    mla = fa_quant_type == "FAKQuant"
    if target is not None:
        check_target(target, mla=mla, model_quant_type=model_quant_type)
    extra: dict[str, torch.Tensor] = {}
    c8: dict[str, torch.Tensor] = {}
    fa_scales: ScaleMap = {}
    if target == "vllm" or (target == "vllm-ascend" and not mla):
        if not kv_scales:
            raise ValueError(
                f"no KV-cache scales to export for --target {target} (the recipe "
                "selected no attention module)"
            )
        _, kv_heads, dim = _model_geometry(config)
        if target == "vllm":
            extra = vllm_kv_tensors(
                kv_scales, kv_strategy, dict.fromkeys(kv_scales, kv_heads)
            )
        else:
            c8 = c8_tensors(kv_scales, dict.fromkeys(kv_scales, kv_heads * dim))
            extra = c8
    elif not reads_fa((config or {}).get("model_type"), str(target)):
        # DeepSeek Sparse Attention: the consumer reads no FA scale (releases)
        if model_quant_type not in LINEAR_QUANT_TYPES:
            raise UnsupportedError(
                f"--target {target} reads no attention scales for model type "
                f"{(config or {}).get('model_type')!r} (its sparse attention keeps "
                "the latent cache as it runs it): quantize the linears "
                "(--linear w8a8 / w8a8_dynamic), or write a research artifact "
                "without --target"
            )
    else:
        if not scales:
            raise ValueError(
                "no FA scales to export (the recipe selected no attention module)"
            )
        fa_scales = scales
        extra = fa_tensors(scales)
    if target == "mindie":
        # q/k/v biases MindIE's model loads that the source lacks: exact zeros
        model_type = (config or {}).get("model_type")
        qkv = [n for n in state_dict if n.endswith(_QKV)]
        shapes = {n: tuple(state_dict[n].shape) for n in qkv}
        biases = mindie_attention_biases(model_type, shapes)
        extra = {**extra, **{n: torch.zeros(k, dtype=dtype) for n, k in biases}}
        types.update(dict.fromkeys((n for n, _ in biases), "FLOAT"))
    clash = sorted(set(extra) & set(state_dict))
    if clash:
        raise ValueError(
            f"quantization tensor names collide with model tensors: {clash[:3]}"
        )
    tensors: Mapping[str, torch.Tensor] = (
        state_dict.with_extra(extra)
        if isinstance(state_dict, LazyTensors)
        else {**state_dict, **extra}
    )
    shard_bytes = parse_size(max_shard_size)
    source = read_source_config(source_dir)
    with atomic_output_dir(output, overwrite=overwrite, force=force) as tmp:
        _write_shards(tmp, tensors, shard_bytes)
        if target != "vllm":
            write_json(
                tmp / DESCRIPTION_FILE,
                target_description(
                    target,
                    types,
                    model_quant_type=model_quant_type,
                    fa_scales=fa_scales,
                    fa_quant_type=fa_quant_type,
                    c8=c8,
                    metadata=metadata,
                ),
            )
        copied = copy_model_files(source_dir, tmp)
        if not set(copied) & set(TOKENIZER_FILES) and tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if config is not None or source is not None:
            cfg = target_config(
                config or {}, target, dtype, kv_strategy=kv_strategy, source=source
            )
            if target == "mindie":
                # what MindIE's router for this family reads beside the source's
                # keys: quantize, moe_quantize, rope_scaling (.mindie_models)
                cfg.update(
                    mindie_config(
                        cfg.get("model_type"),
                        model_quant_type,
                        mixed_moe_linears(types),
                        cfg,
                        types,
                    )
                )
            write_json(tmp / CONFIG_FILE, cfg)
        if report is not None:
            write_json(tmp / REPORT_FILE, report)
        write_extra_files(tmp, extra_files)
    return Path(output)


#: An attention's q/k/v weights and biases (checkpoint names).
_QKV = tuple(
    f".self_attn.{p}_proj.{t}" for p in ("q", "k", "v") for t in ("weight", "bias")
)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(
            path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys
        )
    except (json.JSONDecodeError, UnicodeDecodeError, DuplicateKeyError) as exc:
        raise FileFormatError(f"invalid JSON ({exc})", path=path) from None
    if not isinstance(data, dict):
        raise FileFormatError("not a JSON object", path=path)
    return data


def merge_into(
    target: str | Path,
    *,
    scales: ScaleMap | None = None,
    fa_quant_type: str | None = None,
    output: str | Path | None = None,
    report: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    overwrite: bool = False,
    force: bool = False,
    consumer: str | None = None,
    kv_scales: KVScaleMap | None = None,
    model_config: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Add FA (``consumer`` mindie, or vllm-ascend MLA) or C8 (vllm-ascend GQA,
    ``kv_scales``) tensors to an existing msModelSlim export ``target``.

    The result goes to ``output`` (default: ``target`` itself, replaced atomically).
    Every existing file is copied byte for byte except ``config.json`` (its
    ``quantization_config`` removed) and the description; the new tensors go to
    :data:`FA_WEIGHTS_NAME` (listed in the weights index when ``target`` has one);
    the description keeps every entry and gains the new ones. With ``consumer``
    the result is checked with that consumer's rules
    (:func:`~.inspect.inspect_artifact`) before it is renamed into place.
    Existing FA or C8 tensors are an error (merge into the export without them).
    ``metadata`` joins the description's ``metadata`` object (with ``consumer``).
    """
    from .merge import check_merge_export

    target = Path(target)
    check_merge_export(target, model_config)
    existing = read_tensor_index(target)
    desc = _load_json(target / DESCRIPTION_FILE)
    c8_mode = consumer == "vllm-ascend" and fa_quant_type != "FAKQuant"
    if consumer is not None:
        check_target(consumer, mla=fa_quant_type == "FAKQuant", merge=True)
    if c8_mode:
        if not kv_scales:
            raise ValueError(
                "no C8 scales to merge (the recipe selected no attention module)"
            )
        _, kv_heads, dim = _model_geometry(model_config)
        new = c8_tensors(kv_scales, dict.fromkeys(kv_scales, kv_heads * dim))
        modules = sorted(kv_scales)
    else:
        if not scales:
            raise ValueError(
                "no FA scales to merge (the recipe selected no attention module)"
            )
        new = fa_tensors(scales)
        modules = sorted(scales)
    for attn in modules:
        if not any(n.startswith(attn + ".") for n in existing):
            raise ValueError(
                f"attention module {attn} is not in --merge-into {target} (no tensor "
                f"named {attn}.*); were the scales calibrated on another model?"
            )
    clash = sorted(n for n in new if n in existing or n in desc)
    if clash:
        raise ValueError(
            f"--merge-into {target} already has FA entries (e.g. "
            f"{clash[0]}); merge into an export without them"
        )
    if not c8_mode and desc.get("kv_cache_type") == "C8":
        raise UnsupportedError(
            f"--merge-into {target} has a C8 KV cache; FA and KV-cache quantization "
            "cannot be combined (msModelSlim refuses both)"
        )
    if c8_mode and "fa_quant_type" in desc:
        raise UnsupportedError(
            f"--merge-into {target} has FA quantization; FA and KV-cache quantization "
            "cannot be combined (msModelSlim refuses both)"
        )
    if (target / FA_WEIGHTS_NAME).exists():
        raise ValueError(f"--merge-into {target} already has {FA_WEIGHTS_NAME}")
    output = target if output is None else Path(output)
    in_place = output.absolute() == target.absolute()
    # In place every file of the export is copied into the new directory: nothing
    # of it is lost, so no --force is needed.
    with atomic_output_dir(
        output, overwrite=overwrite or in_place, force=force or in_place
    ) as tmp:
        for src in sorted(target.iterdir()):
            dst = tmp / src.name
            if src.is_dir():
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)
        save_file(new, str(tmp / FA_WEIGHTS_NAME), metadata={"format": "pt"})
        desc.setdefault("model_quant_type", "FLOAT")
        desc.setdefault("version", DESCRIPTION_VERSION)
        if c8_mode:
            desc["kv_cache_type"] = "C8"
            desc["kv_quant_type"] = "C8"
            desc.update(dict.fromkeys(new, "C8"))
        else:
            desc["fa_quant_type"] = fa_quant_type
            for attn in modules:
                desc[f"{attn}.quant_type"] = "INT8"
            desc.update(dict.fromkeys(new, "FAQuant"))
        if consumer is not None:
            meta = desc.get("metadata")
            meta = dict(meta) if isinstance(meta, dict) else {}
            meta[TARGET_METADATA_KEY] = consumer
            desc["metadata"] = {**meta, **(metadata or {})}
        write_json(tmp / DESCRIPTION_FILE, desc)
        for index in sorted(tmp.glob("*.safetensors.index.json")):
            data = _load_json(index)
            data.setdefault("weight_map", {}).update(
                dict.fromkeys(new, FA_WEIGHTS_NAME)
            )
            meta = data.setdefault("metadata", {})
            if isinstance(meta.get("total_size"), int):
                meta["total_size"] += sum(_nbytes(t) for t in new.values())
            write_json(index, data)
        if (tmp / "config.json").is_file():
            # The export's own quantization_config would hide the description from
            # vLLM-based loaders (get_quant_config); msModelSlim removes it too.
            cfg = merged_config(_load_json(tmp / CONFIG_FILE))
            if consumer == "mindie":
                # keys MindIE's config class requires (e.g. DeepSeek's
                # rope_scaling), as the calibrated artifact writes them
                cfg.update(mindie_required_keys(cfg.get("model_type"), cfg))
            write_json(tmp / CONFIG_FILE, cfg)
        if report is not None:
            write_json(tmp / REPORT_FILE, report)
        write_extra_files(tmp, extra_files)
        if consumer is not None:
            from .inspect import inspect_artifact

            # the consumer's rules only: calibrate judged the release (its
            # --consumer-version) before any work
            result = inspect_artifact(tmp, target=consumer, releases=False)
            if not result["valid"]:
                raise UnsupportedError(
                    f"the merged artifact would not load in {consumer}: "
                    + "; ".join(result["findings"][:5])
                )
    return output
