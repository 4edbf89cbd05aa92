"""One settings module for every ``ASCEND_FA_*`` environment variable: each is
declared there, the package reads them only through it, invalid values are one
line naming the variable, and the reference page is generated from it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ascend_fa.atb_ops import settings as ops_settings

from ascend_fa import settings

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "environment.md"
PACKAGE_DIRS = ("ascend_fa", "backends", "atb_ops")
_NAME = re.compile(r"\bASCEND_FA_[A-Z0-9_]+\b")


def _repo_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0].endswith(".egg-info"):
            continue
        if path.suffix in (".py", ".sh", ".md", ".yaml", ".yml", ".toml", ".cfg"):
            if path.is_file():
                yield path


def test_the_product_reexports_the_ops_module():
    assert settings.SETTINGS is ops_settings.SETTINGS
    assert settings.get is ops_settings.get


def test_every_variable_named_in_the_repository_is_declared():
    declared = {s.name for s in settings.SETTINGS}
    named: dict[str, str] = {}
    for path in _repo_files():
        for name in _NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            named.setdefault(name, str(path.relative_to(ROOT)))
    undeclared = {n: f for n, f in named.items() if n not in declared}
    assert not undeclared, f"declare these in atb_ops/settings.py: {undeclared}"
    assert len(declared) == len(settings.SETTINGS)


def _module_strings() -> dict[str, str]:
    """Module-level ``NAME = "ASCEND_FA_..."`` constants of the package."""
    found = {}
    for top in PACKAGE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                    and node.value.value.startswith("ASCEND_FA_")
                ):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            found[target.id] = node.value.value
    return found


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def test_the_package_reads_variables_only_through_the_module():
    """No ``os.environ.get`` / ``os.getenv`` / ``os.environ[...]`` read of an
    ``ASCEND_FA_*`` name (a literal or a constant holding one) outside the
    settings module; a function that saves and restores a variable (it also
    stores into ``os.environ``) may read its raw text."""
    constants = _module_strings()

    def env_name(arg: ast.AST) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value if arg.value.startswith("ASCEND_FA_") else None
        if isinstance(arg, ast.Name):
            return constants.get(arg.id)
        return None

    offences = []
    for top in PACKAGE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "atb_ops" / "settings.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            restoring = set()
            for fn in ast.walk(tree):
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    for node in ast.walk(fn):
                        if (
                            isinstance(node, ast.Subscript)
                            and _is_environ(node.value)
                            and isinstance(node.ctx, ast.Store)
                        ):
                            restoring.update(id(n) for n in ast.walk(fn))
            for node in ast.walk(tree):
                arg = None
                if isinstance(node, ast.Call) and node.args:
                    f = node.func
                    if (
                        isinstance(f, ast.Attribute)
                        and f.attr == "get"
                        and _is_environ(f.value)
                    ) or (
                        isinstance(f, ast.Attribute)
                        and f.attr == "getenv"
                        and isinstance(f.value, ast.Name)
                        and f.value.id == "os"
                    ):
                        arg = node.args[0]
                elif (
                    isinstance(node, ast.Subscript)
                    and _is_environ(node.value)
                    and isinstance(node.ctx, ast.Load)
                ):
                    arg = node.slice
                name = env_name(arg) if arg is not None else None
                if name and id(node) not in restoring:
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not offences, offences


def test_each_declaration_is_complete():
    for s in settings.SETTINGS:
        assert s.name.startswith("ASCEND_FA_") and s.meaning.endswith(".")
        assert s.scope in ("runtime", "tests", "ci")
        for where in s.read_by.split(", "):
            if s.scope == "runtime":
                assert where.startswith("ascend_fa."), where
                rel = where.removeprefix("ascend_fa.").split(".")
                top = {"atb_ops": "atb_ops", "backends": "backends"}.get(rel[0])
                parts = [top, *rel[1:]] if top else ["ascend_fa", *rel]
                assert (ROOT.joinpath(*parts).with_suffix(".py")).is_file(), where
            else:
                assert (ROOT / where).is_file(), where
                assert s.name in (ROOT / where).read_text(encoding="utf-8")


def test_defaults_agree_with_the_code(monkeypatch):
    from ascend_fa import parallel

    for s in settings.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    assert settings.get("ASCEND_FA_DIST_TIMEOUT") == parallel.DEFAULT_TIMEOUT_S
    assert settings.get("ASCEND_FA_NATIVE") is True
    assert settings.get("ASCEND_FA_NO_CACHE") is False
    assert settings.get("ASCEND_FA_VLLM_KV_LAYOUT") == "nd"
    assert settings.get("ASCEND_FA_INT_GEMM") == "auto"
    assert settings.get("ASCEND_FA_BACKEND") is None
    assert settings.get("ASCEND_FA_LOADER_RELEASES") == ()


@pytest.mark.parametrize(
    "name, text, value",
    [
        ("ASCEND_FA_NATIVE", " OFF ", False),
        ("ASCEND_FA_NATIVE", "yes", True),
        ("ASCEND_FA_NATIVE", "", True),  # empty: the default
        ("ASCEND_FA_NO_CACHE", "1", True),
        ("ASCEND_FA_DIST_TIMEOUT", "2.5", 2.5),
        ("ASCEND_FA_VLLM_KV_LAYOUT", "NZ", "nz"),
        ("ASCEND_FA_INT_GEMM", "fp32", "fp32"),
        ("ASCEND_FA_CACHE_DIR", "~/x", Path("~/x").expanduser()),
        ("ASCEND_FA_LOADER_RELEASES", " 0.25.1rc1  main ", ("0.25.1rc1", "main")),
        ("ASCEND_FA_BACKEND", " cpu ", "cpu"),
    ],
)
def test_values_parse(name, text, value, monkeypatch):
    monkeypatch.setenv(name, text)
    assert settings.get(name) == value


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("ASCEND_FA_NATIVE", "maybe", "expected one of 1, true, yes, on, 0, false"),
        ("ASCEND_FA_NO_CACHE", "2", "expected one of 1, true"),
        ("ASCEND_FA_DIST_TIMEOUT", "soon", "expected a positive number"),
        ("ASCEND_FA_DIST_TIMEOUT", "-3", "expected a positive number"),
        ("ASCEND_FA_DIST_TIMEOUT", "inf", "expected a positive number"),
        ("ASCEND_FA_VLLM_KV_LAYOUT", "fractal", "expected nd or nz"),
        ("ASCEND_FA_INT_GEMM", "vnni", "expected auto, int_mm or fp32"),
    ],
)
def test_invalid_values_are_one_line_naming_the_variable(
    name, text, expected, monkeypatch
):
    monkeypatch.setenv(name, text)
    with pytest.raises(settings.SettingError) as err:
        settings.get(name)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    assert message.startswith(f"{name}={text!r}: ") and expected in message


def test_an_undeclared_name_is_refused():
    name = "ASCEND_FA_" + "UNDECLARED"  # split: the scan above would find it
    with pytest.raises(KeyError, match=f"{name} is not a declared"):
        settings.get(name)


def test_the_cli_stops_with_one_line_on_an_invalid_value(monkeypatch, capsys):
    from ascend_fa.cli import main

    monkeypatch.setenv("ASCEND_FA_NATIVE", "maybe")
    assert main(["bench", "kvcache", "--quick", "--tokens", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ascend-fa bench: error: ASCEND_FA_NATIVE='maybe': expected one of 1, true, "
        "yes, on, 0, false, no, off"
    ]


def test_the_committed_page_is_the_generated_one():
    """``docs/reference/environment.md`` equals ``python -m ascend_fa.settings
    --markdown`` (regenerate it after editing a declaration)."""
    out = subprocess.run(
        [sys.executable, "-m", "ascend_fa.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == settings.markdown()
    assert PAGE.read_text(encoding="utf-8") == out, (
        "run: python -m ascend_fa.settings --markdown > docs/reference/environment.md"
    )
    for s in settings.SETTINGS:
        assert f"### {s.name}" in out


def test_listing_the_values_here(monkeypatch, capsys):
    monkeypatch.setenv("ASCEND_FA_INT_GEMM", "int_mm")
    monkeypatch.setenv("ASCEND_FA_VLLM_KV_LAYOUT", "diagonal")
    assert settings.main([]) == 2
    out = capsys.readouterr().out
    assert "ASCEND_FA_INT_GEMM" in out and "'int_mm'" in out
    assert "error: ASCEND_FA_VLLM_KV_LAYOUT='diagonal': expected nd or nz" in out
