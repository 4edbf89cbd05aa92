"""Accuracy of FA quantization: perplexity and per-layer attention-output error.

Every evaluation compares the float model with the same model whose Q, K and V go
through an INT8 quant -> dequant at the FA points (the adapter's ``fa_q``/``fa_k``/
``fa_v``), on held-out text cut into windows of ``window`` tokens ``[N, S]``:

* **perplexity** — ``exp(mean next-token NLL)`` over every window, float and
  fake-quant, and the relative change ``100 · (ppl_fq / ppl_float - 1)`` %;
* **attention-output cosine / relative L1** per attention module — the module's
  output (after ``o_proj``) of the fake-quant run against the float run, with the
  whole model fake-quantized (so earlier layers' error is included, as deployed):
  cosine of the flattened outputs over all tokens, and ``Σ|fq - float| / Σ|float|``.
  These are the definitions of ``calibration_report.json``. The output is a
  residual-stream vector: a model that carries the stream rotated (an artifact
  calibrated with the residual rotation, :mod:`ascend_fa.transforms.residual`:
  ``h' = h Q``, which the default W8A8 recipe applies) writes ``o Q``, so its
  outputs are taken back to the float model's basis (``· Qᵀ``,
  :func:`residual_basis`) before they are compared; compared as written, a
  Hadamard ``Q`` gives a cosine near 0 and a relative L1 near 1.6 for a model
  whose perplexity moved by a few percent.

What is fake-quantized is a :data:`QuantSpec`:

=====================  ==========================================================
spec                   Q, K, V quantization
=====================  ==========================================================
a ``ScaleMap``         static per-head scales ``{attn: {fa_x: (scale [H], offset
                       [H])}}`` (an artifact's, or freshly calibrated); attention
                       modules missing from the map stay float
``"dynamic"``          per token and head: ``scale = max|x[b, h, s, :]| / 127``
                       (:class:`DynamicFakeQuant`) — no static scale can do
                       better, so it is the accuracy upper bound
``"float"``            nothing (a control: must give cosine 1 and equal
                       perplexities)
a ``KVQuantSpec``      a C8 (per-channel int8) or FP8 KV cache: Q float, K and V
                       through the cache round trip the target deploys
                       (:mod:`ascend_fa.calibration.kv`)
=====================  ==========================================================

:func:`read_artifact_spec` reads whichever of these an artifact deploys (FA scales,
C8 ``kv_cache_scale`` or vLLM ``k_scale``/``v_scale``).

:func:`~ascend_fa.calibration.methods.calibrate_methods` calibrates several methods
in one pass for the comparison; :func:`run_eval` is the ``ascend-fa eval`` verb.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.hf import swapped_points
from ascend_fa.adapters.placeholder import FA3QuantPlaceHolder
from ascend_fa.artifact.format import FA_BRANCHES, ScaleMap
from ascend_fa.artifact.provenance import check_artifact_model
from ascend_fa.atb_ops import dynamic_fake_quant
from ascend_fa.calibration.methods import QuantSpec, per_tensor_scales
from ascend_fa.calibration.pipeline import injected_points, progress_bar
from ascend_fa.eval_data import (
    EVAL_SETS,
    LONG_EVAL_SETS,
    data_source,
    eval_text_path,
    load_eval_text,
    token_windows,
)
from ascend_fa.families import is_mla
from ascend_fa.linear import artifact_model
from ascend_fa.linear.io import spec_in_memory
from ascend_fa.metrics import OutputError, residual_basis, token_kl, token_nll
from ascend_fa.safe_files import read_json_object

__all__ = [
    "residual_basis",
    "EVAL_SETS",
    "LONG_EVAL_SETS",
    "ScaleMap",
    "QuantSpec",
    "EvalResult",
    "DynamicFakeQuant",
    "Float32Point",
    "EVAL_DTYPES",
    "eval_text_path",
    "load_eval_text",
    "token_windows",
    "per_tensor_scales",
    "check_scales",
    "read_artifact_scales",
    "read_artifact_spec",
    "evaluate",
    "EvalReport",
    "run_eval",
]

_SPEC_NAMES = ("dynamic", "float")

#: ``eval --dtype``: the model's compute dtype. fp64 gives the same table on every
#: CPU (the FA points still quantize fp32 values, :class:`Float32Point`).
EVAL_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class Float32Point(nn.Module):
    """An FA point of a float64 model (``eval --dtype fp64``): ``inner`` sees
    ``x.float()`` and the result comes back in ``x``'s dtype, so codes and scales
    are formed from the fp32 values, as in an fp32 model. The float64 forward
    keeps two CPUs' activations equal to about 1e-16, where an fp32 forward
    differs in the last bits and flips some codes."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.branch = getattr(inner, "branch", None)
        self.num_heads = getattr(inner, "num_heads", None)
        self.head_dim = getattr(inner, "head_dim", None)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner(x.float(), token_mask).to(x.dtype)


class DynamicFakeQuant(nn.Module):
    """Per token and head INT8 quant -> dequant: ``scale = max(max_d |x| / 127,
    2**-23)`` over the head dimension of each ``x[b, h, s, :]``.

    Same call contract as the FA points: ``x`` ``[B, H, S, D]`` -> same shape and
    dtype; ``token_mask`` is ignored (each token has its own scale).
    """

    def __init__(self, branch: str, num_heads: int, head_dim: int | None = None):
        super().__init__()
        self.branch = branch
        self.num_heads = num_heads
        self.head_dim = head_dim

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dynamic_fake_quant(x, dim=-1)


@dataclass
class EvalResult:
    """Float vs fake-quant on one data set for one :data:`QuantSpec`.

    ``layer_cosine`` / ``layer_rel_l1``: attention module name -> value, in model
    order.
    """

    name: str
    tokens: int
    perplexity_float: float
    perplexity: float
    layer_cosine: dict[str, float] = field(default_factory=dict)
    layer_rel_l1: dict[str, float] = field(default_factory=dict)
    #: mean per-token KL(float || quantized) of the next-token distributions
    kl: float = float("nan")
    #: fraction of positions whose top-1 token equals the float model's
    top1: float = float("nan")

    @property
    def ppl_delta_pct(self) -> float:
        return 100.0 * (self.perplexity / self.perplexity_float - 1.0)

    @property
    def mean_cosine(self) -> float:
        v = list(self.layer_cosine.values())
        return sum(v) / len(v) if v else float("nan")

    @property
    def min_cosine(self) -> float:
        return min(self.layer_cosine.values(), default=float("nan"))

    @property
    def mean_rel_l1(self) -> float:
        v = list(self.layer_rel_l1.values())
        return sum(v) / len(v) if v else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tokens": self.tokens,
            "perplexity_float": self.perplexity_float,
            "perplexity": self.perplexity,
            "perplexity_delta_pct": self.ppl_delta_pct,
            "kl": self.kl,
            "top1": self.top1,
            "mean_attention_output_cosine": self.mean_cosine,
            "min_attention_output_cosine": self.min_cosine,
            "mean_attention_output_rel_l1": self.mean_rel_l1,
            "layers": {
                n: {
                    "attention_output_cosine": self.layer_cosine[n],
                    "attention_output_rel_l1": self.layer_rel_l1[n],
                }
                for n in self.layer_cosine
            },
        }


def _heads(child: nn.Module) -> tuple[int, int | None]:
    return int(child.num_heads), getattr(child, "head_dim", None)


def check_scales(mods: Mapping[str, nn.Module], scales: ScaleMap) -> None:
    """Raise ``ValueError`` naming the tensor when ``scales`` do not fit the FA
    points ``mods`` (attention module name -> module holding ``fa_*``)."""
    if not scales:
        raise ValueError("no FA scales to evaluate (the scale map is empty)")
    for attn, branches in scales.items():
        if attn not in mods:
            example = next(iter(mods), "-")
            raise ValueError(
                f"{attn}.fa_q.scale: the model has no attention module {attn!r} "
                f"(its attention modules are named like {example!r}); were the "
                "scales calibrated on another model?"
            )
        for branch in FA_BRANCHES:
            tensor = f"{attn}.{branch}.scale"
            if branch not in branches:
                raise ValueError(f"{tensor}: missing")
            scale = branches[branch][0]
            heads, _ = _heads(mods[attn]._modules[branch])
            if scale.dim() != 1 or scale.shape[0] != heads:
                raise ValueError(
                    f"{tensor} has shape {tuple(scale.shape)} but the model's "
                    f"{branch} has {heads} heads; expected [{heads}]"
                )
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                raise ValueError(f"{tensor} must be finite and > 0")


def read_artifact_scales(directory: str | Path) -> ScaleMap:
    """The FA scales of an artifact directory (ours or msModelSlim's).

    ``FileNotFoundError`` for a missing directory, ``ValueError`` for one without
    FA tensors.
    """
    from ascend_fa.artifact.reader import read_fa_scales
    from ascend_fa.errors import FileFormatError, NotFoundError

    path = Path(directory)
    if not path.is_dir():
        raise NotFoundError(f"artifact not found: {path}", path=path)
    scales = read_fa_scales(path)
    if not scales:
        raise FileFormatError(
            f"artifact {path} has no FA scales (no <attn>.fa_{{q,k,v}}.scale tensors)",
            path=path,
        )
    return scales


def read_artifact_spec(directory: str | Path, fp8_rounding: str = "nearest") -> Any:
    """What an artifact deploys: its FA scales (a ``ScaleMap``), ``"float"``
    attention beside quantized linears (an artifact without attention scales), or
    a :class:`~ascend_fa.calibration.kv.KVQuantSpec` for C8 / FP8 KV-cache scales
    (C8 scales rounded to the artifact's ``torch_dtype``, as the device holds
    them; FP8 codes rounded as ``fp8_rounding`` says: ``"nearest"`` for vLLM on
    CUDA, ``"trunc"`` for vLLM on CPU). ``"trunc"`` for an artifact without FP8
    KV scales is refused."""

    from ascend_fa.artifact.reader import read_fa_scales, read_kv_scales
    from ascend_fa.artifact.targets import resolve_dtype
    from ascend_fa.calibration.kv import KVQuantSpec, fp8_rounding_flag

    fp8_rounding_flag(fp8_rounding)
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"artifact not found: {path}")
    scales = read_fa_scales(path)
    kv = None if scales else read_kv_scales(path)
    if fp8_rounding != "nearest" and (kv is None or kv[0] != "fp8"):
        raise ValueError(
            f"--fp8-rounding {fp8_rounding}: artifact {path} has no FP8 KV-cache "
            "scales (a --target vllm artifact); the rounding applies to those only"
        )
    if scales:
        return scales
    if kv is None and _linears_only(path):
        return "float"  # quantized linears only (DeepSeek Sparse Attention)
    if kv is None:
        raise ValueError(
            f"artifact {path} has no FA or KV-cache scales (no <attn>.fa_{{q,k,v}}"
            ".scale, <attn>.{k,v}_proj.kv_cache_scale or <attn>.{k,v}_scale)"
        )
    kind, kv_scales = kv
    dtype = None
    cfg_path = path / "config.json"
    if kind == "c8" and cfg_path.is_file():
        cfg = read_json_object(cfg_path, what="config")
        name = cfg.get("torch_dtype")
        if name in ("float16", "bfloat16"):
            dtype = resolve_dtype(name)
    return KVQuantSpec(kind, kv_scales, dtype, fp8_rounding)


def _linears_only(path: Path) -> bool:
    """Whether the artifact at ``path`` deploys quantized linears and no attention
    scales: what the Ascend targets write for a model whose consumer reads none
    (DeepSeek Sparse Attention, :mod:`ascend_fa.artifact.releases`)."""
    from ascend_fa.artifact.format import DESCRIPTION_FILE, LINEAR_QUANT_TYPES

    if not (path / DESCRIPTION_FILE).is_file():
        return False
    desc = read_json_object(path / DESCRIPTION_FILE, what="description")
    return isinstance(desc, dict) and desc.get("model_quant_type") in (
        LINEAR_QUANT_TYPES
    )


def _point_for(spec: QuantSpec | None, name: str, wide: bool = False) -> Any:
    """``make(attn, branch, point)`` for :func:`swapped_points`: a float placeholder
    (``None`` / ``"float"``), dynamic or static fake-quant at every FA point
    (behind a :class:`Float32Point` when ``wide``: a float64 model)."""
    from ascend_fa.calibration import FA3FakeQuant

    def make(attn: str, branch: str, point: nn.Module) -> nn.Module:
        new = build(attn, branch, point)
        return Float32Point(new) if wide else new

    def build(attn: str, branch: str, point: nn.Module) -> nn.Module:
        heads, dim = _heads(point)
        if spec == "dynamic":
            return DynamicFakeQuant(branch, heads, dim)
        if callable(getattr(spec, "point", None)):
            return spec.point(attn, branch, point)
        if isinstance(spec, Mapping) and attn in spec:
            scale, offset = spec[attn][branch]
            return FA3FakeQuant(branch, scale.reshape(-1), offset.reshape(-1), dim)
        return FA3QuantPlaceHolder(branch, heads, dim)

    return make


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: list[torch.Tensor],
    specs: Mapping[str, QuantSpec],
    *,
    batch_size: int = 1,
    progress: bool = False,
    models: Mapping[str, nn.Module] | None = None,
) -> dict[str, EvalResult]:
    """Float vs each of ``specs`` on ``windows`` (token ids ``[S]`` each).

    Injects FA points when the model has none (removed afterwards; a model that
    already has them gets its own ``fa_*`` modules back). Per batch: one float
    forward, then one forward per spec. Returns ``{spec name: EvalResult}``.
    Static scale maps are checked against the model first (:func:`check_scales`).

    ``models`` maps a spec name to the model that spec runs on (e.g. a copy with
    an artifact's quantized linears, :mod:`ascend_fa.linear`); other specs run on
    ``model``, which always gives the float reference. Every spec also gets the
    mean token KL against the float model and the top-1 agreement.
    """
    if not windows:
        raise ValueError("evaluate: no evaluation windows")
    if not specs:
        raise ValueError("evaluate: nothing to evaluate (no quantization specs)")
    for key, spec in specs.items():
        if isinstance(spec, str) and spec not in _SPEC_NAMES:
            raise ValueError(
                f"evaluate: spec {key!r} must be a scale map, 'dynamic' or 'float', "
                f"got {spec!r}"
            )
    device = next(model.parameters()).device
    wide = next(model.parameters()).dtype == torch.float64
    models = dict(models or {})
    runs = {key: models.get(key, model) for key in specs}
    distinct = {id(m): m for m in (model, *runs.values())}
    with contextlib.ExitStack() as stack:
        points = {
            i: stack.enter_context(injected_points(m))[1] for i, m in distinct.items()
        }
        mods = points[id(model)]
        for key, spec in specs.items():
            if callable(getattr(spec, "check", None)):
                spec.check(points[id(runs[key])])
            elif not isinstance(spec, str):
                check_scales(points[id(runs[key])], spec)
        names = list(mods)
        errs = {k: {n: OutputError() for n in names} for k in specs}
        # a model carrying the residual stream rotated: its outputs in the
        # float model's basis (module doc)
        back = {id(m): residual_basis(model, m) for m in distinct.values()}
        nll = dict.fromkeys(specs, 0.0)
        kls = {k: [0.0, 0, 0] for k in specs}
        nll_float = 0.0
        count = 0
        captured: dict[str, torch.Tensor] = {}

        def hook(name: str) -> Any:
            def fn(_m: nn.Module, _a: tuple, out: Any) -> None:
                t = out[0] if isinstance(out, tuple) else out
                captured[name] = t.detach().double()

            return fn

        handles = [
            m.register_forward_hook(hook(n))
            for pts in points.values()
            for n, m in pts.items()
        ]
        order = sorted(range(len(windows)), key=lambda i: -windows[i].numel())
        bar = (
            progress_bar(len(windows) * (1 + len(specs)), "evaluate", "forward")
            if progress
            else None
        )
        try:
            i = 0
            while i < len(order):
                # Batch only windows of equal length: no padding, exact NLL.
                n = windows[order[i]].numel()
                group = [order[i]]
                while (
                    len(group) < batch_size
                    and i + len(group) < len(order)
                    and windows[order[i + len(group)]].numel() == n
                ):
                    group.append(order[i + len(group)])
                i += len(group)
                ids = torch.stack([windows[j] for j in group]).to(device)
                with swapped_points(mods, _point_for(None, "float", wide)):
                    ref_logits = model(input_ids=ids, use_cache=False).logits
                s, c = token_nll(ref_logits, ids)
                nll_float += s
                count += c
                ref = dict(captured)
                if bar is not None:
                    bar.update(len(group))
                for key, spec in specs.items():
                    make = _point_for(spec, key, wide)
                    with swapped_points(points[id(runs[key])], make):
                        out = runs[key](input_ids=ids, use_cache=False)
                    nll[key] += token_nll(out.logits, ids)[0]
                    # KL/top-1 over the positions that predict a token (as NLL).
                    kl, same, num = token_kl(ref_logits[:, :-1], out.logits[:, :-1])
                    kls[key][0] += kl
                    kls[key][1] += same
                    kls[key][2] += num
                    del out
                    q = back[id(runs[key])]
                    for name in names:
                        got = captured[name]
                        if q is not None:
                            got = got @ q.to(got.device).T
                        errs[key][name].add(ref[name], got)
                    if bar is not None:
                        bar.update(len(group))
                del ref_logits
        finally:
            for h in handles:
                h.remove()
            if bar is not None:
                bar.close()
    ppl_float = math.exp(nll_float / count)
    results = {}
    for key in specs:
        cos, rel = {}, {}
        for name in names:
            err = errs[key][name]
            aa, bb = err.sums[1].item(), err.sums[2].item()
            diff = err.sums[3].item()
            # Two all-zero outputs are identical: cosine 1, no relative error.
            cos[name] = err.cosine(empty=float(aa == bb))
            rel[name] = err.rel_l1(empty=float(diff != 0))
        kl_sum, same, num = kls[key]
        results[key] = EvalResult(
            key,
            count,
            ppl_float,
            math.exp(nll[key] / count),
            cos,
            rel,
            kl=kl_sum / num if num else float("nan"),
            top1=same / num if num else float("nan"),
        )
    return results


@dataclass
class EvalReport:
    """What :func:`run_eval` measured: ``results[data set][method]`` and timings."""

    model: str
    artifact: str | None
    results: dict[str, dict[str, EvalResult]]
    timings: dict[str, float] = field(default_factory=dict)

    def table(self) -> tuple[str, list[str], list[list[str]]]:
        """``(title, headers, rows)``: one row per method, four columns per data
        set (ppl with its change, mean cosine, min cosine, mean rel-L1), plus a
        float row."""

        def fmt(v: float | None, spec: str) -> str:
            bad = v is None or (isinstance(v, float) and math.isnan(v))
            return "n/a" if bad else format(v, spec)

        domains = list(self.results)
        methods = list(next(iter(self.results.values())))
        headers = ["method"]
        for d in domains:
            headers += [
                f"{d} ppl (Δ%)",
                f"{d} KL",
                f"{d} top-1",
                f"{d} cos mean",
                f"{d} cos min",
                f"{d} rel-L1",
            ]
        rows: list[list[str]] = [["float"]]
        for d in domains:
            ppl = self.results[d][methods[0]].perplexity_float
            rows[0] += [f"{ppl:.4f}", "0", "1", "1", "1", "0"]
        for m in methods:
            row = [m]
            for d in domains:
                r = self.results[d][m]
                row += [
                    f"{r.perplexity:.4f} ({r.ppl_delta_pct:+.3f}%)",
                    fmt(r.kl, ".5f"),
                    fmt(r.top1, ".4f"),
                    fmt(r.mean_cosine, ".5f"),
                    fmt(r.min_cosine, ".5f"),
                    fmt(r.mean_rel_l1, ".5f"),
                ]
            rows.append(row)
        tokens = ", ".join(
            f"{d} {next(iter(r.values())).tokens}" for d, r in self.results.items()
        )
        title = (
            f"FA Q/K/V INT8 fake-quant vs float ({tokens} predicted tokens; "
            "cosine/rel-L1 of each attention module's output, whole model "
            "fake-quantized)"
        )
        return title, headers, rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "artifact": self.artifact,
            "timings": self.timings,
            "results": {
                d: {m: r.to_dict() for m, r in res.items()}
                for d, res in self.results.items()
            },
        }


def run_eval(
    model: str | Path | None = None,
    *,
    gguf_file: str | None = None,
    artifact: str | Path | None = None,
    data: list[str | Path] | None = None,
    compare_methods: bool = False,
    calib_data: str | Path | None = None,
    num_samples: int = 32,
    max_length: int = 512,
    batch_size: int = 4,
    window: int = 512,
    max_tokens: int | None = None,
    progress: bool = True,
    fp8_rounding: str = "nearest",
    dtype: str = "fp32",
) -> EvalReport:
    """The ``ascend-fa eval`` verb: the artifact's scales and/or every calibration
    method, float vs fake-quant on each data set (default: the packaged prose and
    code texts). ``fp8_rounding`` is an FP8 artifact's cache rounding
    (:func:`read_artifact_spec`). Bad artifacts and data files fail before the
    model loads.

    ``dtype`` (:data:`EVAL_DTYPES`) is the model's compute dtype for calibration
    and evaluation; ``"fp64"`` makes the numbers the same on every CPU and thread
    count (an artifact with quantized linears or changed weights is refused: those
    run in fp32)."""
    from ascend_fa.calibration.data import load_calib_texts
    from ascend_fa.calibration.methods import (
        calibrate_methods,
        calibration_split,
        default_methods,
    )
    from ascend_fa.errors import InputError
    from ascend_fa.models import load_model

    if artifact is None and not compare_methods:
        raise InputError(
            "nothing to evaluate: pass --artifact DIR and/or --compare-methods"
        )
    if dtype not in EVAL_DTYPES:
        raise InputError(
            f"--dtype must be one of {', '.join(EVAL_DTYPES)}, got {dtype!r}"
        )
    for flag, value in (
        ("num_samples", num_samples),
        ("max_length", max_length),
        ("batch_size", batch_size),
        ("window", window),
    ):
        if value <= 0:
            raise InputError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if max_tokens is not None and max_tokens <= 0:
        raise InputError(f"--max-tokens must be > 0, got {max_tokens}")
    artifact_scales = (
        read_artifact_spec(artifact, fp8_rounding) if artifact is not None else None
    )
    if artifact is not None:  # another model's artifact, broken linears: refused
        check_artifact_model(artifact, model)
    packaged = {*EVAL_SETS, *LONG_EVAL_SETS}
    sources: dict[str, str | Path | None] = (
        {(p if p in packaged else Path(p).stem): data_source(p) for p in data}
        if data
        else dict.fromkeys(EVAL_SETS)
    )
    texts = {
        name: load_eval_text(src if src is not None else name)
        for name, src in sources.items()
    }
    loaded = load_model(model, gguf_file, dtype=EVAL_DTYPES[dtype])
    net, tok = loaded.model, loaded.tokenizer
    windows = {
        name: token_windows(tok, t, window=window, max_tokens=max_tokens)
        for name, t in texts.items()
    }
    specs: dict[str, Any] = {}
    timings: dict[str, float] = {}
    models: dict[str, Any] = {}
    if artifact_scales is not None:
        label = f"artifact {Path(artifact).name}"
        if fp8_rounding != "nearest":
            label += f" (FP8 {fp8_rounding})"
        specs[label] = spec_in_memory(net, artifact_scales)
        quantized = artifact_model(net, artifact)
        if quantized is not None and dtype != "fp32":
            raise InputError(
                f"--dtype {dtype}: artifact {artifact} has quantized linears or "
                "weights of its own, which evaluate in fp32 only; use --dtype fp32"
            )
        if quantized is not None:
            # The artifact's quantized linears (and its smoothed float weights) run
            # through the integer path; the float reference stays the source model.
            models[label] = quantized
    if compare_methods:
        calib = calibration_split(load_calib_texts(calib_data), num_samples)
        # the width of one observed head: MLA observes the latent (kv_lora_rank
        # wide; its config's head_dim is the RoPE part's)
        head_dim = int(
            getattr(net.config, "kv_lora_rank", None)
            or getattr(net.config, "head_dim", None)
            or net.config.hidden_size // net.config.num_attention_heads
        )
        methods = default_methods(len(calib) * max_length * head_dim)
        if is_mla(getattr(net.config, "model_type", None)):
            # the clip searches score the GQA attention output (calibrate
            # --clip-search is GQA-only): MLA compares the other methods
            methods = [m for m in methods if m.search is None]
        t0 = time.perf_counter()
        specs.update(
            calibrate_methods(
                net,
                tok,
                calib,
                methods,
                max_length=max_length,
                batch_size=batch_size,
                progress=progress,
            )
        )
        timings["calibrate_all_methods_s"] = time.perf_counter() - t0
    elif artifact_scales is not None:
        specs["dynamic per-token-per-head"] = "dynamic"
        if models:
            models["dynamic per-token-per-head"] = next(iter(models.values()))
    results = {}
    for name, win in windows.items():
        t0 = time.perf_counter()
        results[name] = evaluate(net, win, specs, progress=progress, models=models)
        timings[f"evaluate_{name}_s"] = time.perf_counter() - t0
    source = (
        str(loaded.source_dir / loaded.gguf_file)
        if loaded.gguf_file
        else str(loaded.source_dir)
    )
    return EvalReport(
        model=source,
        artifact=None if artifact is None else str(artifact),
        results=results,
        timings=timings,
    )
