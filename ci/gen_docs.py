"""Generate the documentation pages that are data, not prose.

* ``docs/reference/cli.md``: every ``ascend-fa`` command, its options and their
  defaults, read from the argparse parsers the CLI builds (``build_parser``, and
  each benchmark's ``bench_parser``), so the page cannot drift from the code.
* The result tables of ``docs/benchmarks/*.md`` and ``docs/accuracy/*.md``: a
  block between ``<!-- generated: results/NAME.json -->`` and
  ``<!-- /generated -->`` is rendered from that committed ``ascend-fa-bench/1``
  document (what ``ascend-fa bench NAME --json`` writes), never edited by hand.

``python ci/gen_docs.py`` rewrites the pages; ``--check`` writes nothing and exits 1
naming every page whose committed text differs from what it would write (CI and
``tests/test_docs.py`` run it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "reference" / "cli.md"
BLOCK = re.compile(
    r"(<!-- generated: (?P<src>[\w./-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)",
    re.S,
)
#: Files outside docs/ that hold generated blocks.
EXTRA_PAGES = (ROOT / "README.md",)

__all__ = [
    "render_cli",
    "render_results",
    "render_support_matrix",
    "render_pages",
    "main",
]


# ----------------------------------------------------------------- CLI reference
def _cell(text: str) -> str:
    """Text fit for one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = dict(vars(action), prog=prog)
        for name, value in list(params.items()):
            if isinstance(value, (list, tuple)):
                params[name] = ", ".join(map(str, value))
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    return text


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS or value is False:
        return ""
    if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
        return ""
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value))
    # a default under the user's home reads the same on every machine
    value = str(value).replace(str(Path.home()), "~")
    return f"`{value}`"


def _argument(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action.choices, dict):
        return "`" + "\\|".join(map(str, action.choices)) + "`"
    metavar = action.metavar or (action.dest.upper() if action.option_strings else "")
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.nargs in ("*", "+"):
        return f"`{metavar} ...`"
    if isinstance(action.nargs, int) and action.nargs > 1:
        return "`" + " ".join([metavar] * action.nargs) + "`"
    return f"`{metavar}`" if metavar else ""


def _options_table(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    rows = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):  # noqa: SLF001
            continue
        if action.help is argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            name = f"`{action.metavar or action.dest}`"
        rows.append(
            f"| {name} | {_argument(action)} | {_default(action)} | "
            f"{_cell(_help(action, prog))} |"
        )
    if not rows:
        return []
    return ["| option | argument | default | meaning |", "|---|---|---|---|", *rows]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, Any]:
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            helps = {c.dest: c.help for c in action._choices_actions}  # noqa: SLF001
            return {
                name: (sub, helps.get(name, "")) for name, sub in action.choices.items()
            }
    return {}


def _section(
    parser: argparse.ArgumentParser, prog: str, level: int, summary: str
) -> list[str]:
    out = [f"{'#' * level} `{prog}`", ""]
    if summary:
        out += [_cell(summary), ""]
    table = _options_table(parser, prog)
    if table:
        out += [*table, ""]
    return out


def render_cli() -> str:
    """The CLI reference page, from the parsers. Defaults that come from the
    environment (the cache directory) are rendered as an unset environment gives
    them, under ``~``, so the page is the same on every machine."""
    saved = {k: os.environ.pop(k) for k in _MACHINE_ENV if k in os.environ}
    try:
        return _render_cli()
    finally:
        os.environ.update(saved)


#: Environment variables that move a default the CLI reference shows.
_MACHINE_ENV = ("ASCEND_FA_CACHE_DIR", "XDG_CACHE_HOME")


def _render_cli() -> str:
    from ascend_fa.benchmarks import benchmark_index
    from ascend_fa.cli import build_parser
    from ascend_fa.cli.bench import bench_parser

    top = build_parser()
    out = [
        "# Command line reference",
        "",
        "<!-- Generated by ci/gen_docs.py from the argparse parsers: do not edit. -->",
        "",
        "Every verb is `ascend-fa VERB [options]` (also `python -m ascend_fa VERB`).",
        "`-v` / `--debug` and `-q` / `--quiet` are accepted before and after the verb.",
        "An input error is one line `ascend-fa VERB: error: ...` and exit status 2.",
        "",
    ]
    out += _section(top, "ascend-fa", 2, top.description or "")
    for name, (sub, summary) in sorted(_subparsers(top).items()):
        prog = f"ascend-fa {name}"
        out += _section(sub, prog, 2, summary)
        if name == "bench":
            import importlib

            for info in benchmark_index():
                module = importlib.import_module(info.module)
                bp = bench_parser(module)
                out += _section(bp, f"{prog} {info.name}", 3, info.help)
            subs = _subparsers(sub)
            if "compare" in subs:
                cmp, summary = subs["compare"]
                out += _section(cmp, f"{prog} compare", 3, summary)
            continue
        for child, (cp, csummary) in sorted(_subparsers(sub).items()):
            out += _section(cp, f"{prog} {child}", 3, csummary)
    return "\n".join(out).rstrip() + "\n"


# -------------------------------------------------------------- result documents
def _number(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_number(v) for v in value) + "]"
    return str(value)


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_number(v)}" for k, v in params.items())


def _seconds(value: float | None) -> str:
    if value is None:
        return ""
    if value >= 1:
        return f"{value:.3g} s"
    return f"{value * 1e3:.3g} ms"


def render_results(path: Path, link: str) -> str:
    """One ``ascend-fa-bench/1`` document as markdown: where it was measured,
    then one row per record (every field of the record, scalar extras as
    ``key=value``). ``link`` is the document's path relative to the page."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    if doc.get("schema") != "ascend-fa-bench/1":
        raise ValueError(f"{path}: not an ascend-fa-bench/1 document")
    env = doc["environment"]
    lines = [
        f"Rendered from [`{path.name}`]({link}): measured on {env.get('cpu')} "
        f"({env.get('cpu_count')} CPUs, {env.get('threads')} torch threads), "
        f"torch {env.get('torch')}, Python {env.get('python')}, ascend-fa "
        f"{env.get('ascend_fa')} at `{env.get('git_revision')}`.",
        "",
        "| benchmark | mode | params | median | spread | repeats | ratio | "
        "baseline | goal | verdict | extra |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in doc["records"]:
        extra = {
            k: v
            for k, v in rec.get("extra", {}).items()
            if isinstance(v, (int, float, str, bool)) or v is None
        }
        lines.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    rec["benchmark"],
                    rec["mode"],
                    _params(rec["params"]),
                    _seconds(rec["median_s"]),
                    _number(rec.get("spread")),
                    _number(rec.get("repeats")),
                    _number(rec.get("ratio")),
                    rec.get("baseline") or "",
                    rec.get("goal") or "",
                    rec.get("verdict") or "",
                    _params(extra),
                )
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- support matrix
_FAMILY_ROWS = (
    ("llama",),
    ("mistral",),
    ("qwen2",),
    ("qwen3",),
    ("qwen3_moe",),
    ("qwen2_moe",),
    ("glm4_moe",),
    ("mixtral",),
    ("minimax_m2",),
    ("qwen3_next",),
    ("gemma3_text",),
    ("qwen3_5", "qwen3_5_moe"),
    ("gpt_oss",),
    ("llama4_text",),
    ("gemma4_text",),
    ("ernie4_5_moe",),
    ("deepseek_v3",),
    ("kimi_k2",),
    ("deepseek_v32", "glm_moe_dsa"),
)


def _mindie_cell(model_type: str) -> str:
    from ascend_fa.artifact.mindie_models import mindie_model

    m = mindie_model(model_type)
    if m is None or m.model is None:
        return "no model"
    if m.refusal is not None:
        return "refused"
    if m.fa3 is not None:
        return f"{m.fa3} + W8A8"
    if m.attn is not None:
        return f"linears only ({m.attn.upper()} attention, W8A8_DYNAMIC MLP)"
    return "linears only (W8A8_DYNAMIC)" if m.uniform else "linears only"


#: release rules that say vllm-ascend quantizes nothing of the family
_NO_QUANT_RULES = ("quant.no-mapping", "quant.gemma4-no-plan", "quant.ernie-no-mapping")


def _vllm_ascend_cell(model_type: str, release: Any) -> str:
    from ascend_fa import families
    from ascend_fa.artifact import releases

    arch = releases.architecture({"model_type": model_type})
    scheme = releases.release_scheme(
        "vllm-ascend",
        families.is_mla(model_type),
        families.reads_fa(model_type, "vllm-ascend"),
    )
    rule = releases.rule_for(release, scheme, arch)
    if rule is not None and rule.scheme == "*" and not rule.loads:
        # a rule about the model itself, whatever the artifact quantizes
        if rule.id in _NO_QUANT_RULES:
            return "no quantization"
        return "silently wrong" if rule.silent else "load error"
    if scheme == "linears":
        return "linears only"
    if rule is None:
        return "?"
    if rule.loads:
        return f"{scheme}" + (" (caveat)" if rule.caveat else "")
    return "silently wrong" if rule.silent else "load error"


def _vllm_cell(model_type: str) -> str:
    from ascend_fa import families

    kind = families.attention_kind(model_type)
    if kind is None or kind.name.startswith("mla") or not kind.kv_cache_targets:
        return "refused"
    return "FP8 KV"


def render_support_matrix() -> str:
    """Family x consumer x release, from the rules ``calibrate`` and ``inspect``
    apply (:mod:`ascend_fa.artifact.releases`, ``mindie_models``, ``families``):
    what each consumer release loads of the artifact ``--target`` writes."""
    from ascend_fa.artifact import releases

    vllm_ascend = [r for r in releases.RELEASES if r.target == "vllm-ascend"]
    head = ["family", "MindIE 3.0.0", *[f"vllm-ascend {r.name}" for r in vllm_ascend]]
    head.append("vLLM")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in _FAMILY_ROWS:
        t = group[0]
        cells = [
            ", ".join(f"`{g}`" for g in group),
            _mindie_cell(t),
            *[_vllm_ascend_cell(t, r) for r in vllm_ascend],
            _vllm_cell(t),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_pages() -> dict[Path, str]:
    """Every generated page and its text."""
    pages = {CLI_PAGE: render_cli()}
    for page in [*sorted(DOCS.rglob("*.md")), *EXTRA_PAGES]:
        text = page.read_text(encoding="utf-8")
        if "<!-- generated: " not in text:
            continue

        def fill(m: re.Match, page: Path = page) -> str:
            src = m.group("src")
            if src == "support-matrix":
                body = render_support_matrix()
            elif src.endswith(".json"):
                body = render_results(page.parent / src, src)
            else:
                raise ValueError(f"{page}: unknown generated block {src!r}")
            return m.group(1) + "\n" + body + "\n" + m.group(4)

        pages[page] = BLOCK.sub(fill, text)
    return pages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if stale"
    )
    args = p.parse_args(argv)
    stale = []
    for page, text in render_pages().items():
        old = page.read_text(encoding="utf-8") if page.exists() else None
        if old == text:
            continue
        stale.append(page.relative_to(ROOT).as_posix())
        if not args.check:
            page.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(
            "stale generated docs (run python ci/gen_docs.py): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    for name in stale:
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
