"""The README and the docs are executed: every shell and Python snippet of
``README.md`` and of every ``docs/**/*.md`` page runs (a stale one fails).

A fenced block tagged ``bash`` or ``python`` is a snippet. The HTML comment on the
line before it, if any, says how it is checked:

* no comment — run it in a fresh temporary directory (cwd), with the repository's
  ``README`` assets reachable through ``$REPO``; it must exit 0;
* ``<!-- readme: slow -->`` — the same, in the slow suite (it loads the demo model);
* ``<!-- readme: synopsis -->`` — a usage line with placeholders: every
  ``ascend-fa VERB [SUB]`` it names must exist and every ``--flag`` it shows must
  appear in that command's ``--help``;
* ``<!-- readme: skip REASON -->`` — not run here (e.g. it needs an NPU or installs
  packages); the reason is required;
* ``<!-- readme-numbers: ci -->`` — the command of a numbers table: run and compared
  by ``tests/test_readme_numbers.py`` (slow), not here.

Blocks tagged ``text`` (or untagged) are output and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: Every page whose snippets run: the README, then the docs site's pages.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*readme:\s*(\w+)\s*(.*?)\s*-->\s*$")
_NUMBERS = re.compile(r"^<!--\s*readme-numbers:\s*\w+\s*-->\s*$")


def page_snippets(page: Path) -> list[tuple[int, str, str, str, str]]:
    """``(line, language, mode, reason, code)`` of every bash/python block of
    ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if lang in ("bash", "python"):
            mark = _MARK.match(lines[start - 1]) if start else None
            mode, reason = (mark.group(1), mark.group(2)) if mark else ("run", "")
            if start and _NUMBERS.match(lines[start - 1]):
                mode = "numbers"
            out.append((start + 1, lang, mode, reason, "\n".join(lines[i + 1 : j])))
        i = j + 1
    return out


def snippets() -> list[tuple[str, int, str, str, str, str]]:
    """``(page, line, language, mode, reason, code)`` of every bash/python block
    of every page (:data:`PAGES`); ``page`` relative to the repository."""
    return [
        (page.relative_to(ROOT).as_posix(), *s)
        for page in PAGES
        for s in page_snippets(page)
    ]


SNIPPETS = snippets()


def _id(s: tuple) -> str:
    return f"{s[0]}:{s[1]}-{s[2]}-{s[3]}"


def test_every_snippet_has_a_known_mode():
    assert any(s[0] == "README.md" for s in SNIPPETS), "the README has no snippets"
    assert any(s[0].startswith("docs/") for s in SNIPPETS), "the docs have none"
    for page, line, _lang, mode, reason, _code in SNIPPETS:
        assert mode in ("run", "slow", "synopsis", "skip", "numbers"), (
            f"{page}:{line}: {mode}"
        )
        if mode == "skip":
            assert reason, f"{page}:{line}: a skipped snippet needs a reason"


def test_quickstart_has_the_two_setup_commands_ci_runs():
    """The README's Quickstart holds exactly two commands: the set-up with the
    demo calibration, and the one ``.ci/run`` runs (the test command)."""
    text = README.read_text(encoding="utf-8")
    quick = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)\n```$", quick, re.M | re.S)
    assert blocks == [
        "bash ci/setup.sh && ascend-fa calibrate --output out/smollm2",
        "bash ci/setup.sh dev && bash ci/test.sh",
    ], blocks
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert run[-1] == blocks[1], run[-1]


def _run(lang: str, code: str, tmp_path: Path, timeout: int) -> None:
    env = dict(os.environ, REPO=str(ROOT), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    if lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    proc = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
        f"{proc.stderr[-3000:]}"
    )


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s[3] == "run"], ids=_id)
def test_snippet_runs(snippet, tmp_path):
    _run(snippet[2], snippet[5], tmp_path, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s[3] == "slow"], ids=_id)
def test_slow_snippet_runs(snippet, tmp_path):
    _run(snippet[2], snippet[5], tmp_path, timeout=3600)


def _help(argv: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_fa", *argv, "--help"],
        capture_output=True,
        text=True,
        env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
    )
    assert proc.returncode == 0, f"ascend-fa {' '.join(argv)} --help failed"
    return proc.stdout


@pytest.mark.parametrize(
    "snippet", [s for s in SNIPPETS if s[3] == "synopsis"], ids=_id
)
def test_synopsis_matches_the_cli(snippet):
    code = snippet[5].replace("\\\n", " ")
    for line in code.splitlines():
        m = re.match(r"\s*ascend-fa\s+([a-z0-9-]+)(?:\s+([a-z][a-z0-9-]*))?", line)
        if not m:
            continue
        verb, sub = m.group(1), m.group(2)
        argv = [verb]
        top = _help([verb])
        if sub and re.search(rf"^\s+{re.escape(sub)}\s", top, re.M):
            argv.append(sub)
            text = _help(argv)
        else:
            text = top
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
            assert flag in text, (
                f"{snippet[0]}:{snippet[1]}: {flag} not in {argv} --help"
            )
