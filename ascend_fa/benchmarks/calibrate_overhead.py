"""``ascend-fa bench calibration-overhead``: calibration wall time vs plain forwards.

On SmolLM2-135M-Instruct (the demo model; ``--quick`` uses a randomly initialised
model of the same architecture so it needs no download and no GGUF load) it feeds
``--num-samples`` x ``--seq-len`` tokens of the packaged calibration text, in
batches of ``--batch-size``, through

* **plain**: the bare model (``use_cache=False, logits_to_keep=1``, as
  ``ascend-fa calibrate`` calls it);
* **ours**: the default recipe (recall window, union; exact two-level ``topk`` of
  the tails) — injection, observers, and the final qparams;
* **packaged default**: the recipe ``ascend-fa calibrate`` uses (recall window,
  pooled, ``max_samples`` tightened to this run's exact bound);
* **seed (sort)**: the same calibration with the seed's sort-based window: every
  update sorts each head's samples (``recall_window_sort_ref``) — emulated here for
  comparison;
* **clip search**: the extra time of the attention-output clip search
  (:mod:`ascend_fa.calibration.search`) on the retained rows, reported on top of
  ours;
* **packaged + W8A8 observers**: one pass collecting attention and linear
  statistics together — the packaged recipe's FA observers and, on the first
  linear of every W8A8 group, the statistics hook ``calibrate --linear w8a8``
  observes with (:class:`~ascend_fa.linear.search.InputStats`: per-channel range,
  per-update bounds, row sample);
* **W8A8 linears** (not interleaved, informative): the whole layer-sequential
  linear calibration (observe, search, propagate; no fallback scan), alone and
  followed by the FA pass — what the observers ride on plus the searches.

Every variant runs its forwards through the one calibration loop
(:func:`ascend_fa.calibration.pipeline.run_forwards`), one batch at a time. The
forward variants run interleaved batch by batch (plain, ours, seed) so
that load changes on a shared machine hit them alike; each variant's time is the
sum over batches after one untimed warm-up forward. Ratios are against plain in the
same run; the goal for ours and the packaged recipe is <= 1.25x, with the W8A8
observers <= 1.35x. The scales of ours and of the sort-based emulation must be
identical (same windows, same union) and are checked.

``--json`` writes the one result schema (:mod:`.results`): one record per variant
(``mode`` ``plain``, ``ours``, ``packaged``, ``seed_sort``, ``ours_clip_search``,
``w8a8_observers``, ``w8a8_linears``, ``w8a8_linears_fa``) whose ``median_s`` is
the variant's total over the batches (one timed pass, ``repeats`` 1), ``spread``
the relative spread of its per-batch times, ``ratio`` against ``plain``, and the
goal's verdict.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, NamedTuple

import torch
from torch import nn

from ._util import print_table
from .results import Record, Timing, machine_line, verdict, write_results

NAME = "calibration-overhead"
HELP = "calibration wall time (default recipe) vs the same plain forwards; seed's sort"

GOAL = 1.25
#: A calibration pass with the FA observers and the W8A8 statistics hooks (issue
#: goal) vs plain forwards.
LINEAR_GOAL = 1.35
#: (record mode, table label) of the two whole-W8A8 rows (no goal: they include
#: the searches), in :func:`_linear_overhead`'s order.
LINEAR_MODES = (
    (
        "w8a8_linears",
        "W8A8 linears, whole: layer-sequential observe + search + propagate",
    ),
    (
        "w8a8_linears_fa",
        "W8A8 linears, whole, + FA pass riding on them (calibrate --linear w8a8)",
    ),
)


def _w8a8_hooks(model: nn.Module) -> list[Any]:
    """Hooks recording every W8A8 group's input as ``calibrate --linear w8a8``
    does (:func:`ascend_fa.linear.observe_layer`: an ``InputStats`` per group on
    its first linear, real-token rows); returns the handles."""
    from ascend_fa.linear import LinearConfig, linear_plan
    from ascend_fa.linear.engine import real_rows
    from ascend_fa.linear.search import InputStats

    cfg = LinearConfig()
    handles = []
    for plan in linear_plan(model):
        for gi, group in enumerate(plan.groups):
            first = model.get_submodule(group.linears[0])
            st = InputStats(first.in_features, rows=cfg.search_rows, seed=gi)

            def hook(_m: nn.Module, args: tuple, st: InputStats = st) -> None:
                x = args[0]
                st.update(real_rows(x, torch.ones(x.shape[:-1], dtype=torch.bool)))

            handles.append(first.register_forward_pre_hook(hook))
    return handles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf (default: the SmolLM2 demo model; "
        "--quick: random weights of its architecture)",
    )
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --model")
    parser.add_argument(
        "--num-samples", type=int, default=0, help="samples (default 32, quick 4)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="tokens per sample (default 512, quick 128)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=4, help="samples per forward (default 4)"
    )
    parser.add_argument(
        "--no-search", action="store_true", help="skip timing the clip search"
    )


def _smollm2_like() -> tuple[nn.Module, str]:
    """Random-weight model with SmolLM2-135M's architecture, and a tokenizer-free
    vocabulary size (inputs are token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model, "random-init SmolLM2-135M architecture (30 layers, 9/3 heads)"


def _token_ids(tokenizer: Any, vocab: int, n: int, length: int) -> torch.Tensor:
    """``[n, length]`` token ids: the packaged calibration text, tokenized and
    repeated as needed (random ids when there is no tokenizer)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab, (n, length), generator=g)
    from ascend_fa.calibration.data import load_calib_texts

    text = "\n\n".join(load_calib_texts())
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    reps = -(-n * length // ids.numel())
    return ids.repeat(reps)[: n * length].view(n, length)


class _SortWindowObserver(nn.Module):
    """The seed's method: per update, sort every head's samples and take the
    narrowest window covering ``int(ratio * N)`` of them; union across updates."""

    def __init__(self, num_heads: int, ratio: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ratio = ratio
        self.lo = torch.full((num_heads,), float("inf"))
        self.hi = torch.full((num_heads,), float("-inf"))

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        from ascend_fa.calibration import recall_window_sort_ref

        xs = x.detach()
        if token_mask is not None and not bool(token_mask.all()):
            rows = xs.transpose(0, 1)[:, token_mask].reshape(self.num_heads, -1)
        else:
            rows = xs.transpose(0, 1).reshape(self.num_heads, -1)
        lo, hi = recall_window_sort_ref(rows, self.ratio)
        self.lo = torch.minimum(self.lo, lo)
        self.hi = torch.maximum(self.hi, hi)
        return x


def _linear_overhead(
    model: nn.Module, batches: list[torch.Tensor], recipe: Any
) -> dict[str, float]:
    """Seconds of the W8A8 calibration on copies of ``model``: the
    layer-sequential linear pass alone (observe, decide, propagate; no fallback
    scan), and with the FA pass riding on it, observing each layer's quantized
    outputs (what ``calibrate --linear w8a8 --linear-fallback 0`` runs)."""
    import copy
    from types import SimpleNamespace

    from ascend_fa.calibration.pipeline import AttentionObserving
    from ascend_fa.linear import LinearConfig, calibrate_linears

    dicts = [{"input_ids": b} for b in batches]
    from ascend_fa.transforms.residual import supports_rotation

    # calibrate's default: the residual stream rotated where the family takes it
    rotate = supports_rotation(model)
    config = LinearConfig("W8A8", torch.bfloat16, fallback=0, rotate=rotate)
    work = copy.deepcopy(model)
    t = time.perf_counter()
    calibrate_linears(work, dicts, config)
    t_lin = time.perf_counter() - t
    work = copy.deepcopy(model)
    length = int(batches[0].shape[1]) if batches else 0
    texts = sum(int(b.shape[0]) for b in batches)
    t = time.perf_counter()
    packaged = SimpleNamespace(processors=[recipe])
    with AttentionObserving(work, packaged, texts, length) as observing:
        calibrate_linears(work, dicts, config, propagate=observing.propagate)
    observing.result().remove(work)
    t_both = time.perf_counter() - t
    return {LINEAR_MODES[0][0]: t_lin, LINEAR_MODES[1][0]: t_both}


class _Setup(NamedTuple):
    """The model, its adapter, the batches and the two recipes every variant
    runs: ``config`` (the default recipe's processor) and ``packaged`` (what
    ``ascend-fa calibrate`` uses, ``max_samples`` tightened to this run)."""

    model: nn.Module
    what: str
    load_s: float
    n: int
    length: int
    batch_size: int
    batches: list[torch.Tensor]
    adapter: Any
    config: Any
    packaged: Any


def _setup(args: argparse.Namespace) -> _Setup:
    from ascend_fa.adapters import get_adapter
    from ascend_fa.calibration import (
        FA3Processor,
        default_recipe,
        find_fa_modules,
        load_recipe,
    )
    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.pipeline import samples_bound, tighten_max_samples

    n = args.num_samples or (4 if args.quick else 32)
    length = args.seq_len or (128 if args.quick else 512)
    bs = args.batch_size
    if min(n, length, bs) <= 0:
        raise ValueError("--num-samples, --seq-len and --batch-size must be > 0")
    t0 = time.perf_counter()
    if args.quick and args.model is None:
        model, what = _smollm2_like()
        tokenizer = None
    else:
        from ascend_fa.models import load_model

        loaded = load_model(args.model, args.gguf_file)
        model, tokenizer = loaded.model, loaded.tokenizer
        what = str(loaded.gguf_file or loaded.source_dir)
    t_load = time.perf_counter() - t0
    ids = _token_ids(tokenizer, model.config.vocab_size, n, length)
    batches = [ids[i : i + bs] for i in range(0, n, bs)]
    config = default_recipe().processors[0]
    adapter = get_adapter(model)
    # The packaged recipe `ascend-fa calibrate` uses (pooled recall window), with
    # max_samples lowered to the exact bound of this run, as the command does.
    probe = FA3Processor(config)
    probe.preprocess(model, adapter)
    bound = samples_bound(find_fa_modules(model), n, length)
    adapter.remove_fa3_placeholders(model)
    (packaged,) = load_recipe(default_recipe_path()).processors
    packaged = tighten_max_samples(packaged, bound)
    return _Setup(
        model, what, t_load, n, length, bs, batches, adapter, config, packaged
    )


class _Variant:
    """One interleaved variant: the recipe it injects, how it makes each point's
    persistent module (``make(name, branch, observer)``), whether the W8A8
    statistics hooks ride along; its modules, total and per-batch seconds."""

    def __init__(self, cfg: Any, make: Any = None, hooks: bool = False) -> None:
        self.cfg, self.make, self.hooks = cfg, make, hooks
        self.modules: dict[tuple[str, str], nn.Module] | None = None
        self.seconds = 0.0
        self.per_batch: list[float] = []

    def attach(self, s: _Setup) -> None:
        """Inject, then put the persistent per-point modules in place."""
        from ascend_fa.adapters.hf import set_point
        from ascend_fa.calibration import FA_BRANCHES, FA3Processor, find_fa_modules

        proc = FA3Processor(self.cfg)
        proc.preprocess(s.model, s.adapter)
        if self.modules is None:
            self.modules = {}
            proc.process(s.model)
            for name, mod in find_fa_modules(s.model).items():
                for b in FA_BRANCHES:
                    self.modules[(name, b)] = self.make(name, b, mod._modules[b])
        for name, mod in find_fa_modules(s.model).items():
            for b in FA_BRANCHES:
                set_point(mod, b, self.modules[(name, b)])

    def run_batch(self, s: _Setup, batch: torch.Tensor) -> None:
        from ascend_fa.calibration.pipeline import run_forwards

        t = time.perf_counter()
        if self.make is not None:
            self.attach(s)
        hooks = _w8a8_hooks(s.model) if self.hooks else []
        run_forwards(s.model, [{"input_ids": batch}])
        for h in hooks:
            h.remove()
        if self.make is not None:
            s.adapter.remove_fa3_placeholders(s.model)
        self.per_batch.append(time.perf_counter() - t)
        self.seconds += self.per_batch[-1]

    def finish(self, qparams: Any) -> Any:
        """``qparams(modules)`` timed as part of this variant; its value."""
        t = time.perf_counter()
        out = qparams(self.modules or {})
        self.seconds += time.perf_counter() - t
        return out


def _variants(
    args: argparse.Namespace, s: _Setup, search_cfg: Any
) -> tuple[dict[str, _Variant], dict[str, dict[str, Any]]]:
    """The interleaved variants (plain, ours, pooled, w8a8, seed, in the order
    each batch runs them) and the sample keepers ours fills for the clip
    search."""
    from ascend_fa.calibration.search import KeepingObserver, SampleKeeper

    keepers: dict[str, dict[str, SampleKeeper]] = {}

    def make_ours(name: str, b: str, obs: nn.Module) -> nn.Module:
        if args.no_search:
            return obs
        keeper = SampleKeeper(search_cfg.rows, search_cfg.tokens)
        keepers.setdefault(name, {})[b] = keeper
        return KeepingObserver(obs, keeper)

    def make_seed(name: str, b: str, obs: nn.Module) -> nn.Module:
        return _SortWindowObserver(obs.num_heads, s.config.branch_settings(b).ratio)

    def keep(_n: str, _b: str, obs: nn.Module) -> nn.Module:
        return obs

    variants = {
        "plain": _Variant(None),
        "ours": _Variant(s.config, make_ours),
        "pooled": _Variant(s.packaged, keep),
        "w8a8": _Variant(s.packaged, keep, hooks=True),
        "seed": _Variant(s.config, make_seed),
    }
    return variants, keepers


def _measure(
    s: _Setup, variants: dict[str, _Variant]
) -> tuple[dict[tuple[str, str], Any], bool]:
    """Every batch through every variant in turn (after one warm-up forward),
    then each variant's final qparams; ours' scales and whether the sort-based
    emulation gives the identical scales."""
    from ascend_fa.atb_ops import per_head_qparams
    from ascend_fa.calibration import FA3Observer
    from ascend_fa.calibration.search import KeepingObserver

    def ours_qparams(mods: dict) -> dict:
        scales = {}
        for key, mod in mods.items():
            obs = mod.inner if isinstance(mod, KeepingObserver) else mod
            assert isinstance(obs, FA3Observer)
            scales[key] = obs.observer.qparams()[0]
        return scales

    def observer_qparams(mods: dict) -> None:
        for mod in mods.values():
            mod.observer.qparams()

    with torch.no_grad():
        s.model(input_ids=s.batches[0], use_cache=False, logits_to_keep=1)  # warm-up
        for batch in s.batches:
            for variant in variants.values():
                variant.run_batch(s, batch)
        ours = variants["ours"].finish(ours_qparams)
        variants["pooled"].finish(observer_qparams)
        variants["w8a8"].finish(observer_qparams)
        seed = variants["seed"].finish(
            lambda mods: {k: per_head_qparams(m.lo, m.hi)[0] for k, m in mods.items()}
        )
    return ours, all(torch.equal(ours[k], seed[k]) for k in ours)


def _clip_search_seconds(
    s: _Setup, ours: dict, keepers: dict, search_cfg: Any
) -> float:
    """Seconds of the clip search from ours' scales on the kept rows."""
    from ascend_fa.calibration import FA_BRANCHES, FA3Processor, find_fa_modules
    from ascend_fa.calibration.search import search_scales

    proc = FA3Processor(s.config)
    proc.preprocess(s.model, s.adapter)
    mods = find_fa_modules(s.model)
    start = {name: {b: ours[(name, b)] for b in FA_BRANCHES} for name in mods}
    t = time.perf_counter()
    search_scales(mods, start, keepers, search_cfg)
    t_search = time.perf_counter() - t
    s.adapter.remove_fa3_placeholders(s.model)
    return t_search


def run(args: argparse.Namespace) -> int:
    from ascend_fa.calibration.search import SearchConfig

    s = _setup(args)
    search_cfg = SearchConfig(rows=2, tokens=128) if args.quick else SearchConfig()
    variants, keepers = _variants(args, s, search_cfg)
    ours, identical = _measure(s, variants)
    t_search = None
    if not args.no_search:
        t_search = _clip_search_seconds(s, ours, keepers, search_cfg)
    linear = _linear_overhead(s.model, s.batches, s.packaged)
    entries = _entries(variants, t_search, search_cfg, linear)
    _print_report(s, entries, identical)
    _write_records(args, s, entries, identical, t_search)
    return 0 if identical else 1


#: (mode, label, seconds, goal, per-batch samples) of one table row
_Entry = tuple[str, str, float, "str | None", list[float]]


def _entries(
    variants: dict[str, _Variant],
    t_search: float | None,
    search_cfg: Any,
    linear: dict[str, float],
) -> list[_Entry]:
    v = variants
    entries: list[_Entry] = [
        ("plain", "plain forwards", v["plain"].seconds, None, v["plain"].per_batch),
        (
            "ours",
            "calibration, ours (recall window union, exact topk tails)",
            v["ours"].seconds,
            f"<= {GOAL}",
            v["ours"].per_batch,
        ),
        (
            "packaged",
            "calibration, packaged default recipe (recall window, pooled)",
            v["pooled"].seconds,
            f"<= {GOAL}",
            v["pooled"].per_batch,
        ),
        (
            "seed_sort",
            "calibration, seed method (sort per update, emulated)",
            v["seed"].seconds,
            None,
            v["seed"].per_batch,
        ),
    ]
    if t_search is not None:
        entries.append(
            (
                "ours_clip_search",
                f"ours + clip search ({search_cfg.rows}x{search_cfg.tokens} "
                "tokens/layer)",
                v["ours"].seconds + t_search,
                None,
                [],
            )
        )
    entries.append(
        (
            "w8a8_observers",
            "calibration pass, packaged recipe + W8A8 statistics hooks",
            v["w8a8"].seconds,
            f"<= {LINEAR_GOAL}",
            v["w8a8"].per_batch,
        )
    )
    for (mode, label), secs in zip(LINEAR_MODES, linear.values(), strict=True):
        entries.append((mode, label, secs, None, []))
    return entries


def _print_report(s: _Setup, entries: list[_Entry], identical: bool) -> None:
    base = entries[0][2]
    rows = [
        [
            label,
            f"{secs:.2f}",
            f"{secs / base:.2f}x",
            "" if goal is None else verdict(secs / base, goal).upper(),
        ]
        for _mode, label, secs, goal, _samples in entries
    ]
    print(
        f"model: {s.what} (load {s.load_s:.1f} s); {s.n} samples x {s.length} "
        f"tokens, batch {s.batch_size}, {len(s.batches)} forwards per variant, "
        f"{torch.get_num_threads()} threads"
    )
    print(machine_line())
    print_table(
        ["variant", "seconds", "vs plain", "goal"],
        rows,
        title="Calibration overhead (Q/K/V per head, ratio 0.9999/0.9999/1.0); "
        f"goals: <= {GOAL}x plain, <= {LINEAR_GOAL}x with the W8A8 observers",
    )
    print(
        f"ours and the sort-based emulation give identical scales: "
        f"{'yes' if identical else 'NO'}"
    )
    for mode, _label, secs, goal, _samples in entries:
        if goal is not None:
            word = "ok" if verdict(secs / base, goal) == "ok" else "NOT MET"
            print(f"{mode}: {secs / base:.2f}x plain ({goal}x: {word})")


def _write_records(
    args: argparse.Namespace,
    s: _Setup,
    entries: list[_Entry],
    identical: bool,
    t_search: float | None,
) -> None:
    base = entries[0][2]
    params = {
        "model": s.what,
        "num_samples": s.n,
        "seq_len": s.length,
        "batch_size": s.batch_size,
    }
    records = [
        Record(
            NAME,
            "cpu",
            mode,
            params,
            secs,
            spread=Timing(tuple(samples)).spread if samples else 0.0,
            repeats=1,
            ratio=secs / base,
            baseline="plain",
            goal=goal,
            verdict=verdict(secs / base, goal),
            extra={"label": label, "per_batch_s": samples},
        )
        for mode, label, secs, goal, samples in entries
    ]
    write_results(
        args.json,
        records,
        backend="cpu",
        extra={
            "identical_scales": identical,
            "clip_search_seconds": t_search,
            "load_seconds": s.load_s,
        },
    )
