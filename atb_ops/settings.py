"""Every ``ASCEND_FA_*`` environment variable, declared once: name, type, default,
meaning, and the code that reads it.

Code reads a variable through :func:`get` (the parsed, validated value; the default
when the variable is unset or empty), never through ``os.environ``: the value is
read on every call, so a test or a benchmark can switch a setting in-process, and a
value that is not one of the accepted spellings stops the caller with one line
naming the variable (:class:`SettingError`, a ``ValueError``: the CLI prints it
and exits 2).

The module lives in the ops layer (``ascend_fa.atb_ops.settings``) because imports
only go down (``ascend_fa`` -> ``backends`` -> ``atb_ops``) and the ops read
settings too (``ASCEND_FA_NATIVE``, ``ASCEND_FA_INT_GEMM``): only the lowest layer
is importable by all three. It holds data and parsing only, no product logic, and
``ascend_fa.settings`` re-exports it. ``python -m ascend_fa.settings --markdown``
prints the reference page ``docs/reference/environment.md`` (a test keeps the
committed page equal to it).

=========  ==================================================================
type       accepted values (case-insensitive; surrounding blanks ignored)
=========  ==================================================================
``bool``   ``1 true yes on`` / ``0 false no off``
``choice`` one of the listed words
``number`` a positive decimal number
``text``   any non-empty string (the reader checks it)
``path``   a file-system path (``~`` expanded)
``words``  blank-separated words
=========  ==================================================================
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SETTINGS",
    "Setting",
    "SettingError",
    "get",
    "is_set",
    "lookup",
    "main",
    "markdown",
    "raw",
]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_TYPES = ("bool", "choice", "number", "text", "path", "words")


class SettingError(ValueError):
    """An environment variable holds a value its type does not accept (one line:
    ``NAME='value': expected ...``)."""


@dataclass(frozen=True)
class Setting:
    """One environment variable. ``default`` is what :func:`get` returns when it is
    unset or empty (``shown``: how the docs write it, when the value alone does not
    say it); ``read_by`` names the module (or script) that reads it; ``scope`` is
    ``runtime`` (the package), ``tests`` or ``ci``."""

    name: str
    type: str
    default: object
    meaning: str
    read_by: str
    choices: tuple[str, ...] = ()
    shown: str | None = None
    scope: str = "runtime"

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise ValueError(f"{self.name}: unknown setting type {self.type!r}")
        if (self.type == "choice") != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with type 'choice' only")

    def raw(self) -> str | None:
        """The variable's text, stripped; None when unset or empty."""
        text = os.environ.get(self.name)
        if text is None or not text.strip():
            return None
        return text.strip()

    def parse(self, text: str) -> object:
        """``text`` (stripped, non-empty) as this setting's value, or
        :class:`SettingError`."""
        if self.type == "bool":
            low = text.lower()
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise SettingError(
                f"{self.name}={text!r}: expected one of {', '.join(_TRUE + _FALSE)}"
            )
        if self.type == "choice":
            low = text.lower()
            if low in self.choices:
                return low
            raise SettingError(f"{self.name}={text!r}: expected {_spell(self.choices)}")
        if self.type == "number":
            try:
                value = float(text)
            except ValueError:
                value = -1.0
            if not 0 < value < float("inf"):
                raise SettingError(f"{self.name}={text!r}: expected a positive number")
            return value
        if self.type == "path":
            return Path(text).expanduser()
        if self.type == "words":
            return tuple(text.split())
        return text

    def value(self) -> object:
        """The parsed value, or ``default`` when unset."""
        text = self.raw()
        return self.default if text is None else self.parse(text)

    def values_text(self) -> str:
        """The accepted values, as the docs write them."""
        if self.type == "choice":
            return " \\| ".join(f"`{c}`" for c in self.choices)
        return {
            "bool": "`1` \\| `0` (true/false, yes/no, on/off)",
            "number": "positive number",
            "text": "text",
            "path": "path",
            "words": "blank-separated words",
        }[self.type]

    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return f"`{int(self.default)}`"
        if isinstance(self.default, float) and self.default.is_integer():
            return f"`{int(self.default)}`"
        return f"`{self.default}`"


def _spell(words: Sequence[str]) -> str:
    if len(words) == 1:
        return words[0]
    return f"{', '.join(words[:-1])} or {words[-1]}"


#: Every variable, in the order of the reference page.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "ASCEND_FA_BACKEND",
        "text",
        None,
        "Forces the attention backend by name (`cpu`, `cuda`, `npu`, or a "
        "third-party backend of the `ascend_fa.backends` entry-point group) instead "
        "of the available one with the highest priority (npu, then cuda, then "
        "cpu). A backend that is unknown or not usable here is an error that lists "
        "every backend with its reason.",
        "ascend_fa.backends.registry",
        shown="unset (the highest-priority usable backend)",
    ),
    Setting(
        "ASCEND_FA_TORCH_NPU_RELEASE",
        "text",
        None,
        "The torch_npu release whose capability table the NPU backend reads "
        "(e.g. `7.2.0`), instead of the release detected from the loaded torch_npu "
        "(or, before it is loaded, the newest known). An unknown release is an "
        "error that lists the known ones.",
        "ascend_fa.backends.npu",
        shown="unset (detected; the newest known before torch_npu loads)",
    ),
    Setting(
        "ASCEND_FA_NATIVE",
        "bool",
        True,
        "`0` keeps the eager torch path for the CPU kernels that have a native C "
        "version (paged cache write, decode attention, FP8 block dequantize, "
        "linear epilogues): nothing is compiled. Read on every call.",
        "ascend_fa.atb_ops.native",
    ),
    Setting(
        "ASCEND_FA_NATIVE_CACHE",
        "path",
        None,
        "Directory for the compiled native library. Only a directory of the "
        "current user that group and others cannot write is used (the library "
        "runs with the caller's rights).",
        "ascend_fa.atb_ops.native",
        shown="`$XDG_CACHE_HOME/ascend_fa`, else `~/.cache/ascend_fa`, else "
        "`<tmp>/ascend_fa-<uid>`",
    ),
    Setting(
        "ASCEND_FA_INT_GEMM",
        "choice",
        "auto",
        "The exact integer product of the W8A8 linears on the CPU (calibration's "
        "search, the quantized forwards). `int_mm`: torch's int8 GEMM "
        "(`torch._int_mm`, int32 accumulation); `fp32`: fp32 GEMMs over K chunks "
        "of 1024 whose partial sums are exact. Both give the same integers, so "
        "the same artifact. `auto` takes `int_mm` where the CPU has int8 "
        "dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX-INT8) and `fp32` "
        "elsewhere, and times the run's own products on a first use of each shape "
        "(interleaved, with a margin) so that a measured loss of `int_mm` "
        "reverses the choice for that shape. `ascend-fa doctor` and `-v` say "
        "which path runs and why.",
        "ascend_fa.atb_ops.linear",
        choices=("auto", "int_mm", "fp32"),
    ),
    Setting(
        "ASCEND_FA_CACHE_DIR",
        "path",
        None,
        "Root of the model cache (the demo GGUF converted once to safetensors) "
        "and of the consumer environments the tests and benchmarks build "
        "(`ci/vllm_cpu_env.sh`, `ci/vllm_ascend_env.sh`).",
        "ascend_fa.model_cache, ascend_fa.benchmarks.serving",
        shown="`$XDG_CACHE_HOME/ascend-fa`, else `~/.cache/ascend-fa`",
    ),
    Setting(
        "ASCEND_FA_NO_CACHE",
        "bool",
        False,
        "`1` turns the model cache off (as `--no-cache` does): every load "
        "converts the GGUF again.",
        "ascend_fa.model_cache",
    ),
    Setting(
        "ASCEND_FA_DIST_TIMEOUT",
        "number",
        1800.0,
        "Seconds a collective of data-parallel calibration waits for the other "
        "ranks before the run fails (no hang when a rank dies).",
        "ascend_fa.parallel",
    ),
    Setting(
        "ASCEND_FA_VLLM_KV_LAYOUT",
        "choice",
        "nd",
        "Layout of the int8 KV cache of the vLLM plugin's attention: `nd` "
        "(vLLM's own) or `nz` (the device's FRACTAL_NZ blocks; the same codes).",
        "ascend_fa.serving.attention, ascend_fa.serving.mla",
        choices=("nd", "nz"),
    ),
    Setting(
        "ASCEND_FA_CONSUMER",
        "text",
        None,
        "`<target>[@<version>]` (e.g. `vllm-ascend@0.18.0`): the consumer release "
        "whose `inspect` rules the vLLM plugin applies when it loads an artifact; "
        "a target without a version means its newest stable release; unset, the "
        "rules of the target the artifact records, without a release's.",
        "ascend_fa.serving.vllm_config",
        shown="unset (the recorded target's rules)",
    ),
    Setting(
        "ASCEND_FA_LOADER_RELEASES",
        "words",
        (),
        "Extra vllm-ascend releases (e.g. `0.25.1rc1 main`) the slow real-loader "
        "tests run against, beside the registry releases.",
        "tests/test_vllm_ascend_loader.py, tests/test_vllm_ascend_scale_shape.py",
        shown="unset (the registry releases only)",
        scope="tests",
    ),
    Setting(
        "ASCEND_FA_UPDATE_DOCS",
        "bool",
        False,
        "The MindIE own-code test (run with `MINDIE_LLM_SRC`) rewrites "
        "`docs/reference/mindie.md` from its run instead of failing when the page "
        "differs.",
        "tests/test_mindie_own_code.py",
        shown="unset (a differing page fails the test)",
        scope="tests",
    ),
    Setting(
        "ASCEND_FA_TF4_VENV",
        "path",
        None,
        "Where `ci/unit_transformers4.sh` builds (and reuses) the transformers "
        "4.57 test environment.",
        "ci/unit_transformers4.sh",
        shown="`.venv-tf4/` beside the checkout",
        scope="ci",
    ),
)

_BY_NAME = {s.name: s for s in SETTINGS}


def lookup(name: str) -> Setting:
    """The declared setting ``name`` (KeyError for an undeclared one: every
    variable is declared here first)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared ascend-fa setting") from None


def get(name: str) -> object:
    """The value of ``name``: parsed and checked, its default when unset or empty
    (see :class:`Setting`)."""
    return lookup(name).value()


def raw(name: str) -> str | None:
    """The text of ``name`` as set (stripped), or None."""
    return lookup(name).raw()


def is_set(name: str) -> bool:
    return lookup(name).raw() is not None


_SCOPES = {
    "runtime": "Read by the package",
    "tests": "Read by the tests",
    "ci": "Read by the CI scripts",
}


def markdown() -> str:
    """The reference page (``docs/reference/environment.md``)."""
    lines = [
        "# Environment variables",
        "",
        "<!-- generated by `python -m ascend_fa.settings --markdown` from "
        "ascend_fa/atb_ops/settings.py; edit that file, not this page -->",
        "",
        "Every `ASCEND_FA_*` variable, declared in one module "
        "(`ascend_fa.settings`). A variable that is unset or empty takes its "
        "default. Values are read when they are used, not once at import. A value "
        "outside the accepted ones stops the command with one line naming the "
        "variable, for example "
        "`ascend-fa bench: error: ASCEND_FA_NATIVE='maybe': expected one of "
        "1, true, yes, on, 0, false, no, off` (exit 2).",
        "",
        "Accepted spellings are case-insensitive and surrounding blanks are "
        "ignored: a boolean takes `1`, `true`, `yes`, `on` or `0`, `false`, `no`, "
        "`off`; a path expands `~`.",
    ]
    for scope, title in _SCOPES.items():
        group = [s for s in SETTINGS if s.scope == scope]
        if not group:
            continue
        lines += [
            "",
            f"## {title}",
            "",
            "| Variable | Values | Default | Read by |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| [`{s.name}`](#{s.name.lower()}) | {s.values_text()} | "
            f"{s.default_text()} | `{s.read_by}` |"
            for s in group
        ]
        for s in group:
            lines += ["", f"### {s.name}", "", s.meaning]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ascend_fa.settings",
        description="List ascend-fa's environment variables and their values here.",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the reference page"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    status = 0
    for s in SETTINGS:
        text = s.raw()
        try:
            value = s.value()
        except SettingError as exc:
            print(f"error: {exc}")
            status = 2
            continue
        state = f"= {text!r}" if text is not None else "(unset)"
        print(f"{s.name:<28} {state}  -> {value!r}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
