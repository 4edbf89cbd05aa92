"""The documentation site: generated pages up to date, every page in the
navigation, result files of the one schema, the README short and its links alive.

The site itself is built with warnings as errors by ``ci/lint.sh`` (``mkdocs build
--strict``); the snippets of every page run in ``tests/test_readme.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _gen_docs():
    spec = importlib.util.spec_from_file_location(
        "gen_docs", ROOT / "ci" / "gen_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_up_to_date():
    """``python ci/gen_docs.py`` would change nothing: the CLI reference matches
    the parsers, the support matrix the release rules, each rendered table its
    committed result file."""
    stale = [
        page.relative_to(ROOT).as_posix()
        for page, text in _gen_docs().render_pages().items()
        if not page.exists() or page.read_text(encoding="utf-8") != text
    ]
    assert not stale, f"run python ci/gen_docs.py: stale {stale}"


def test_cli_reference_names_every_verb_and_flag():
    from ascend_fa.cli import build_parser

    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    top = build_parser()
    sub = next(a for a in top._actions if a.dest == "command")
    for verb, parser in sub.choices.items():
        assert f"## `ascend-fa {verb}`" in page, verb
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # -h is everywhere; the page does not repeat it
            for flag in action.option_strings:
                assert f"`{flag}`" in page, f"{verb} {flag}"


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert config["theme"]["name"] == "material"
    assert config["strict"] is True


@pytest.mark.parametrize(
    "path", sorted((DOCS / "results").glob("*.json")), ids=lambda p: p.name
)
def test_result_files_are_bench_documents(path):
    from ascend_fa.benchmarks.results import check_results

    doc = check_results(path)
    names = {r["benchmark"] for r in doc["records"]}
    # the file's name says which benchmark wrote it
    assert any(path.name.startswith(n) for n in names), (path.name, names)


def test_every_result_file_is_rendered():
    rendered = set()
    for page in DOCS.rglob("*.md"):
        for src in re.findall(
            r"<!-- generated: ([\w./-]+\.json) -->", page.read_text()
        ):
            rendered.add((page.parent / src).resolve())
    files = {p.resolve() for p in (DOCS / "results").glob("*.json")}
    assert files and files == rendered


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    text = "\n".join(lines)
    for term in (
        "FAQuant",
        "FAKQuant",
        "C8",
        "W8A8",
        "MindIE",
        "vllm-ascend",
        "msModelSlim",
    ):
        assert re.search(rf"^\| \*\*{re.escape(term)}\*\*", text, re.M), term


def test_readme_links_resolve():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(((?:docs|\.)/[^)#]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link
