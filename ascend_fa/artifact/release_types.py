"""The vocabulary of the consumer-release table (:mod:`.releases`): a rule's
citation, a release, a rule, the repositories and the commits they were read at."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "Citation",
    "MAIN",
    "MINDIE",
    "MINDIE300",
    "PR12463",
    "Release",
    "Rule",
    "V013",
    "V018",
    "V023",
    "V0251",
    "VLLM",
    "VLLM_ASCEND",
]

VLLM_ASCEND = "vllm-project/vllm-ascend"
VLLM = "vllm-project/vllm"
MINDIE = "Ascend/MindIE-LLM"


@dataclass(frozen=True)
class Citation:
    """Where a rule was read: repository, path, commit or tag, and the place."""

    repo: str
    path: str
    ref: str
    where: str = ""

    def __str__(self) -> str:
        ref = self.ref[:10] if re.fullmatch(r"[0-9a-f]{40}", self.ref) else self.ref
        at = f" {self.where}" if self.where else ""
        return f"{self.repo}:{self.path}@{ref}{at}"


@dataclass(frozen=True)
class Release:
    """One consumer release: its canonical name, the line it stands for, the
    commit it was read at, the vLLM release it loads through, and whether it is a
    stable (final) release."""

    target: str
    name: str
    line: str
    commit: str
    loader: str
    stable: bool
    aliases: tuple[str, ...] = ()


#: vllm-ascend commits: tags of the git history, and for 0.23.0.post1 (which has
#: no tag) the commit its PyPI sdist records (``vllm_ascend/_version.py``
#: ``commit_id = 'g1cdb8c4db'``); the files the C8 rules read are byte-identical
#: in that sdist and at tag v0.23.0 (5cb98caaad).
V013 = "6281c1207a7a499e9f23a42b3a1e7027469f2b10"  # tag v0.13.0
V018 = "e18643f8a4d5bd9990727654318ad069ea0b56e2"  # tag v0.18.0
V023 = "5cb98caaadeff42b5b62b996e34bb2aaa29d20fd"  # tag v0.23.0
V0251 = "9bf964cb4b87c8cd0d6852c41a55b3c29711fa95"  # tag v0.25.1rc1
# main, 2026-08-22: the commit the rules of .consumers and the npu backend's
# vllm-ascend citations (backends/npu_capabilities.VLLM_ASCEND_COMMIT) were read at
MAIN = "182b75ea84ff13ece27b57391331ef8935410aea"
PR12463 = "86923ba582b9fffb35d9ab9501f52267d0e97874"  # PR #12463 on main
MINDIE300 = "8b4871ad31f592aa863f6255760e4934484d78e4"  # tag v3.0.0


@dataclass(frozen=True)
class Rule:
    """What ``releases`` do with ``scheme`` for ``architectures`` (None: any).

    ``loads`` False: ``effect`` says what happens instead (``silent``: no error,
    the model runs wrongly or unquantized). ``caveat``: the release loads the
    artifact and runs it, but ``effect`` says what part of it goes unused
    (``calibrate`` warns, ``inspect`` prints a note; neither fails). The first
    rule of a release matching the scheme and the architecture decides."""

    id: str
    target: str
    scheme: str
    releases: tuple[str, ...]
    architectures: frozenset[str] | None
    loads: bool
    effect: str
    citations: tuple[Citation, ...]
    silent: bool = False
    caveat: bool = False
    #: what the refusal says the release does (default: "cannot load", or
    #: "silently ignores" for a silent rule)
    verb: str = ""

    def cites(self) -> str:
        return "; ".join(str(c) for c in self.citations)
