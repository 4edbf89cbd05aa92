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
  These are the definitions of ``calibration_report.json``.

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
=====================  ==========================================================

:func:`per_tensor_scales` turns per-head scales into the "per-tensor" baseline (one
scale for all heads of a tensor: the largest). :func:`calibrate_methods` calibrates
several recipes in a single pass over the calibration data (one observer per method
at each FA point), plus the clip search of :mod:`ascend_fa.calibration_search`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_fa.atb_ops.constants import INT8_MAX, INT8_MIN, SCALE_EPS
from ascend_fa.calibration.placeholder import FA_BRANCHES, FA3QuantPlaceHolder
from ascend_fa.calibration_search import SampleKeeper, SearchConfig, search_scales

__all__ = [
    "EVAL_SETS",
    "ScaleMap",
    "QuantSpec",
    "MethodSpec",
    "EvalResult",
    "DynamicFakeQuant",
    "eval_text_path",
    "load_eval_text",
    "token_windows",
    "per_tensor_scales",
    "check_scales",
    "read_artifact_scales",
    "evaluate",
    "default_methods",
    "V_CLIP_RATIOS",
    "calibrate_methods",
    "calibration_split",
]

#: Held-out texts shipped with the package (never used for calibration).
EVAL_SETS = {"prose": "eval_prose.txt", "code": "eval_code.txt"}

#: attention module name -> {"fa_q": (scale [H] fp32, offset [H] int8), ...}
ScaleMap = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]
#: What to fake-quantize: static per-head scales, "dynamic" per token and head, or
#: "float" (nothing).
QuantSpec = ScaleMap | str
_SPEC_NAMES = ("dynamic", "float")


def eval_text_path(name: str) -> Path:
    """Path of a packaged held-out text: ``"prose"`` or ``"code"``."""
    if name not in EVAL_SETS:
        raise ValueError(
            f"unknown evaluation set {name!r}; packaged sets: {', '.join(EVAL_SETS)}"
        )
    return Path(str(resources.files("ascend_fa") / "data" / EVAL_SETS[name]))


def load_eval_text(source: str | Path) -> str:
    """The text of a packaged set name or of a file.

    A ``.jsonl`` file (or one whose first line is a JSON object) is read with the
    calibration-data rules and its samples joined by blank lines; any other file is
    taken as one plain text.
    """
    if isinstance(source, str) and source in EVAL_SETS:
        return eval_text_path(source).read_text(encoding="utf-8")
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"evaluation data not found: {path}")
    from ascend_fa.calib_data import load_calib_texts

    text = path.read_text(encoding="utf-8")
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if path.suffix.lower() in (".jsonl", ".json") or first.lstrip().startswith("{"):
        return "\n\n".join(load_calib_texts(path))
    if not text.strip():
        raise ValueError(f"{path}: evaluation file is empty")
    return text


def token_windows(
    tokenizer: Any,
    text: str,
    *,
    window: int = 512,
    max_tokens: int | None = None,
    min_last: int = 64,
) -> list[torch.Tensor]:
    """Cut ``text``'s tokens into consecutive windows ``[S]`` of ``window`` tokens.

    A shorter last window is kept when it has at least ``min_last`` tokens (or
    when it is the only one). ``max_tokens`` caps the tokens used.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise ValueError("evaluation text has fewer than 2 tokens")
    out = [ids[i:i + window] for i in range(0, ids.numel(), window)]
    if len(out) > 1 and out[-1].numel() < min_last:
        out.pop()
    return out


def per_tensor_scales(scales: ScaleMap) -> ScaleMap:
    """One scale per tensor: every head of ``attn.fa_x`` gets the largest of its
    per-head scales (the range that covers all heads)."""
    out: ScaleMap = {}
    for attn, branches in scales.items():
        out[attn] = {}
        for branch, (scale, offset) in branches.items():
            s = scale.detach().float().reshape(-1)
            out[attn][branch] = (torch.full_like(s, float(s.max())), offset.clone())
    return out


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
        xf = x.float()
        scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=SCALE_EPS)
        q = torch.clamp(torch.round(xf / scale), INT8_MIN, INT8_MAX)
        return (q * scale).to(x.dtype)


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


# ---------------------------------------------------------------- FA points
def _fa_modules(model: nn.Module) -> dict[str, nn.Module]:
    from ascend_fa.calibration import find_fa_modules

    return find_fa_modules(model)


@contextmanager
def _injected(model: nn.Module) -> Iterator[tuple[Any, dict[str, nn.Module]]]:
    """FA points on every attention module for the duration; restores the model's
    own ``fa_*`` children afterwards, or removes the injection if it made it."""
    from ascend_fa.adapters import get_adapter

    adapter = get_adapter(model)
    mods = _fa_modules(model)
    ours = not mods
    if ours:
        adapter.inject_fa3_placeholders("", model, lambda _name: True)
        mods = _fa_modules(model)
    saved = {
        (name, b): m._modules[b]
        for name, m in mods.items()
        for b in FA_BRANCHES
        if b in m._modules
    }
    try:
        yield adapter, mods
    finally:
        if ours:
            adapter.remove_fa3_placeholders(model)
        else:
            for (name, b), child in saved.items():
                mods[name]._modules[b] = child


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
    from ascend_fa.export import read_fa_scales

    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"artifact not found: {path}")
    scales = read_fa_scales(path)
    if not scales:
        raise ValueError(
            f"artifact {path} has no FA scales (no <attn>.fa_{{q,k,v}}.scale "
            "tensors)"
        )
    return scales


def _install(mods: Mapping[str, nn.Module], spec: QuantSpec | None) -> None:
    """Put float placeholders (``None`` or ``"float"``), static fake-quant or
    dynamic fake-quant modules at every FA point."""
    from ascend_fa.calibration import FA3FakeQuant

    for name, module in mods.items():
        for branch in FA_BRANCHES:
            if branch not in module._modules:
                continue
            heads, dim = _heads(module._modules[branch])
            new: nn.Module
            if spec == "dynamic":
                new = DynamicFakeQuant(branch, heads, dim)
            elif isinstance(spec, Mapping) and name in spec:
                scale, offset = spec[name][branch]
                new = FA3FakeQuant(branch, scale.reshape(-1), offset.reshape(-1), dim)
            else:
                new = FA3QuantPlaceHolder(branch, heads, dim)
            module._modules[branch] = new


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return float(nll.double().sum()), int(nll.numel())


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: list[torch.Tensor],
    specs: Mapping[str, QuantSpec],
    *,
    batch_size: int = 1,
    progress: bool = False,
) -> dict[str, EvalResult]:
    """Float vs each of ``specs`` on ``windows`` (token ids ``[S]`` each).

    Injects FA points when the model has none (removed afterwards; a model that
    already has them gets its own ``fa_*`` modules back). Per batch: one float
    forward, then one forward per spec. Returns ``{spec name: EvalResult}``.
    Static scale maps are checked against the model first (:func:`check_scales`).
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
    with _injected(model) as (_adapter, mods):
        for spec in specs.values():
            if not isinstance(spec, str):
                check_scales(mods, spec)
        names = list(mods)
        acc = {k: torch.zeros(len(names), 5, dtype=torch.float64) for k in specs}
        nll = dict.fromkeys(specs, 0.0)
        nll_float = 0.0
        count = 0
        captured: dict[str, torch.Tensor] = {}

        def hook(name: str) -> Any:
            def fn(_m: nn.Module, _a: tuple, out: Any) -> None:
                t = out[0] if isinstance(out, tuple) else out
                captured[name] = t.detach().double()
            return fn

        handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
        order = sorted(range(len(windows)), key=lambda i: -windows[i].numel())
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(windows) * (1 + len(specs)), desc="evaluate",
                       unit="forward", leave=False)
        try:
            i = 0
            while i < len(order):
                # Batch only windows of equal length: no padding, exact NLL.
                n = windows[order[i]].numel()
                group = [order[i]]
                while (len(group) < batch_size and i + len(group) < len(order)
                       and windows[order[i + len(group)]].numel() == n):
                    group.append(order[i + len(group)])
                i += len(group)
                ids = torch.stack([windows[j] for j in group]).to(device)
                _install(mods, None)
                out = model(input_ids=ids, use_cache=False)
                s, c = _nll(out.logits, ids)
                nll_float += s
                count += c
                del out
                ref = dict(captured)
                if bar is not None:
                    bar.update(len(group))
                for key, spec in specs.items():
                    _install(mods, spec)
                    out = model(input_ids=ids, use_cache=False)
                    nll[key] += _nll(out.logits, ids)[0]
                    del out
                    for li, name in enumerate(names):
                        a, b = ref[name], captured[name]
                        acc[key][li] += torch.stack([
                            (a * b).sum(), (a * a).sum(), (b * b).sum(),
                            (a - b).abs().sum(), a.abs().sum()]).cpu()
                    if bar is not None:
                        bar.update(len(group))
        finally:
            for h in handles:
                h.remove()
            if bar is not None:
                bar.close()
    ppl_float = math.exp(nll_float / count)
    results = {}
    for key in specs:
        cos, rel = {}, {}
        for li, name in enumerate(names):
            dot, aa, bb, diff, norm = acc[key][li].tolist()
            # Two all-zero outputs are identical: cosine 1, no relative error.
            cos[name] = dot / math.sqrt(aa * bb) if aa and bb else float(aa == bb)
            rel[name] = diff / norm if norm else float(diff != 0)
        results[key] = EvalResult(key, count, ppl_float,
                                  math.exp(nll[key] / count), cos, rel)
    return results


# ------------------------------------------------------------- calibration
@dataclass(frozen=True)
class MethodSpec:
    """One row of the method comparison.

    ``config``: the ``fa3_quant`` settings whose observers give the scales (None for
    ``dynamic``); ``per_tensor``: collapse to one scale per tensor; ``search``: run
    the clip search from the config's scales; ``dynamic``: per-token-per-head.
    """

    name: str
    config: Any = None
    per_tensor: bool = False
    search: SearchConfig | None = None
    dynamic: bool = False


#: Recall ratios of the best static method measured on SmolLM2: the seed's Q/K
#: ratio, and V clipped to 99.95 % instead of kept whole (see the module notes).
V_CLIP_RATIOS = {"q": 0.9999, "k": 0.9999, "v": 0.9995}


def default_methods(max_samples: int) -> list[MethodSpec]:
    """The comparison of the issue: the observer methods, the per-tensor baseline,
    the clip searches, and dynamic per-token-per-head (upper bound).

    ``max_samples`` bounds the samples per head for ``pooled`` accumulation.
    """
    from ascend_fa.calibration import FA3QuantConfig

    seed = FA3QuantConfig()
    return [
        MethodSpec("recall_window/union (default)", seed),
        MethodSpec("recall_window/union, V ratio 0.9995",
                   FA3QuantConfig(ratio=V_CLIP_RATIOS)),
        MethodSpec("recall_window/pooled",
                   FA3QuantConfig(accumulate="pooled", max_samples=max_samples)),
        MethodSpec("abs_quantile", FA3QuantConfig(method="abs_quantile")),
        MethodSpec("minmax", FA3QuantConfig(method="minmax")),
        MethodSpec("per-tensor (recall_window)", seed, per_tensor=True),
        MethodSpec("clip search: tensor MSE", seed,
                   search=SearchConfig(objective="tensor_mse")),
        MethodSpec("clip search: attention output", seed, search=SearchConfig()),
        MethodSpec("dynamic per-token-per-head", dynamic=True),
    ]


def calibration_split(
    texts: list[str], num_samples: int, heldout: int = 4, seed: int = 0
) -> list[str]:
    """The calibration samples ``ascend-fa calibrate`` uses by default: shuffle with
    ``seed``, set the last ``heldout`` aside, take the first ``num_samples``."""
    from ascend_fa.calib_data import split_calibration

    return split_calibration(texts, num_samples, heldout, seed)[0]


class _FanOut(nn.Module):
    """One FA point feeding several observers (one per method) and, optionally, a
    :class:`SampleKeeper` for the clip search; returns its input."""

    def __init__(self, observers: dict[str, Any], keeper: SampleKeeper | None):
        super().__init__()
        self.observers = observers
        self.keeper = keeper

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        for obs in self.observers.values():
            obs.update(x.detach(), token_mask)
        if self.keeper is not None:
            self.keeper.add(x, token_mask)
        return x


@torch.no_grad()
def calibrate_methods(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    methods: list[MethodSpec],
    *,
    max_length: int = 512,
    batch_size: int = 4,
    progress: bool = False,
) -> dict[str, QuantSpec]:
    """Scales of every method in ``methods`` from one pass over ``texts``.

    Returns ``{method name: ScaleMap or "dynamic"}``. Each FA point runs one
    :class:`~ascend_fa.calibration.PerHeadObserver` per distinct observer config
    (padding excluded through the attention mask, as in ``ascend-fa calibrate``);
    search methods keep their ``rows`` x ``tokens`` samples in the same pass.
    """
    from ascend_fa.calibration import PerHeadObserver
    from ascend_fa.cli.calibrate import tokenize_batch

    if not texts:
        raise ValueError("calibrate_methods: no calibration texts")
    device = next(model.parameters()).device
    configs = {m.config.model_dump_json(): m.config for m in methods if m.config}
    searches = [m.search for m in methods if m.search is not None]
    keep_rows = max((s.rows for s in searches), default=0)
    keep_tokens = max((s.tokens for s in searches), default=0)
    with _injected(model) as (_adapter, mods):
        points: dict[tuple[str, str], _FanOut] = {}
        for name, module in mods.items():
            for branch in FA_BRANCHES:
                heads, _ = _heads(module._modules[branch])
                observers = {}
                for key, cfg in configs.items():
                    if not cfg.matches(name):
                        continue
                    s = cfg.branch_settings(branch)
                    observers[key] = PerHeadObserver(
                        heads, method=s.method, ratio=s.ratio,
                        accumulate=s.accumulate, max_samples=s.max_samples,
                        name=f"{name}.{branch}")
                keeper = SampleKeeper(keep_rows, keep_tokens) if searches else None
                points[(name, branch)] = module._modules[branch] = _FanOut(
                    observers, keeper)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(texts), desc="calibrate", unit="sample", leave=False)
        for i in range(0, len(texts), batch_size):
            chunk = texts[i:i + batch_size]
            model(**tokenize_batch(tokenizer, chunk, max_length, device),
                  use_cache=False, logits_to_keep=1)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        per_config: dict[str, ScaleMap] = {}
        for key in configs:
            smap: ScaleMap = {}
            for (name, branch), point in points.items():
                if key in point.observers:
                    smap.setdefault(name, {})[branch] = point.observers[key].qparams()
            per_config[key] = {n: e for n, e in smap.items() if len(e) == 3}
        kept = {
            name: {b: points[(name, b)].keeper for b in FA_BRANCHES}
            for name in mods
        } if searches else {}
        out: dict[str, QuantSpec] = {}
        for m in methods:
            if m.dynamic:
                out[m.name] = "dynamic"
                continue
            if m.config is None:
                raise ValueError(f"method {m.name!r} has neither a config nor dynamic")
            smap = per_config[m.config.model_dump_json()]
            if m.search is not None:
                start = {n: {b: e[b][0] for b in FA_BRANCHES} for n, e in smap.items()}
                searched, _ = search_scales(mods, start, kept, m.search,
                                            progress=progress)
                smap = {
                    n: {b: (s, smap[n][b][1]) for b, s in e.items()}
                    for n, e in searched.items()
                }
            out[m.name] = per_tensor_scales(smap) if m.per_tensor else smap
    return out
