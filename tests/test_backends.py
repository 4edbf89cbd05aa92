"""Backend registry: selection rules, env override, error listing, plugins."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from ascend_fa.backends import (
    AttentionSpec,
    backend_for_device,
    get_backend,
    list_backends,
    select_backend,
)
from ascend_fa.backends.npu import NPUBackend

import ascend_fa


def test_import_does_not_import_torch_npu():
    code = (
        "import sys, ascend_fa; ascend_fa.get_backend(); "
        "print('torch_npu' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_builtins_listed_with_reasons():
    infos = {i.name: i for i in list_backends()}
    assert {"cpu", "cuda", "npu"} <= set(infos)
    assert infos["cpu"].available and infos["cpu"].reason == ""
    if not torch.cuda.is_available():
        assert not infos["cuda"].available
        assert "torch.cuda.is_available() is False" in infos["cuda"].reason
    assert not infos["npu"].available
    assert "torch_npu" in infos["npu"].reason


def test_auto_selection_prefers_highest_available():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert get_backend().name == expected
    assert ascend_fa.get_backend() is get_backend()  # singletons


def test_explicit_name_and_env_override(monkeypatch):
    assert get_backend("cpu").name == "cpu"
    monkeypatch.setenv("ASCEND_FA_BACKEND", "cpu")
    assert get_backend().name == "cpu"
    # explicit name wins over the environment
    monkeypatch.setenv("ASCEND_FA_BACKEND", "npu")
    assert get_backend("cpu").name == "cpu"


def test_unknown_name_lists_every_backend(monkeypatch):
    with pytest.raises(ValueError) as err:
        get_backend("tpu")
    msg = str(err.value)
    assert "unknown backend 'tpu'" in msg
    for name in ("cpu", "cuda", "npu"):
        assert f"- {name} (built-in)" in msg
    monkeypatch.setenv("ASCEND_FA_BACKEND", "bogus")
    with pytest.raises(
        ValueError, match=r"unknown backend 'bogus' \(set by ASCEND_FA_BACKEND\)"
    ):
        get_backend()


def test_unusable_name_says_why():
    with pytest.raises(ValueError) as err:
        get_backend("npu")
    msg = str(err.value)
    assert "backend 'npu' (requested) is not usable here" in msg
    assert "torch_npu is not installed" in msg
    assert "- cpu (built-in): available" in msg


def test_spec_selection_and_reasons():
    spec = AttentionSpec(
        op="decode",
        mode="int8_kv",
        query_dtype=torch.float16,
        cache_dtype=torch.int8,
        head_dim=64,
        num_heads=8,
        num_kv_heads=2,
        block_size=32,
        layout="nz",
        device_type="cpu",
    )
    assert select_backend(spec).name == "cpu"
    assert select_backend(spec) is select_backend(spec)
    # an NZ int8 cache whose block size is not a multiple of 32 fits nobody
    bad = AttentionSpec(
        op="decode",
        mode="int8_kv",
        query_dtype=torch.float16,
        cache_dtype=torch.int8,
        head_dim=64,
        num_heads=8,
        num_kv_heads=3,
        block_size=16,
        layout="nz",
        device_type="cpu",
    )
    with pytest.raises(ValueError) as err:
        select_backend(bad)
    msg = str(err.value)
    assert "block_size 16 is not a multiple of 32" in msg
    assert "num_heads 8 is not a multiple of num_kv_heads 3" in msg
    assert "npu: unavailable" in msg


def test_npu_constraints_come_from_the_capability_table():
    spec = AttentionSpec(
        op="decode",
        mode="int8_kv",
        query_dtype=torch.float16,
        cache_dtype=torch.int8,
        head_dim=64,
        num_heads=8,
        num_kv_heads=8,
        block_size=64,
        layout="nz",
        device_type="npu",
        has_offsets=True,
    )
    text = "\n".join(NPUBackend(release="26.0.0").unsupported_reasons(spec))
    for rule in (
        "[fia.int8nz.query_dtype]",
        "[fia.int8nz.head_dim]",
        "[fia.int8nz.block_size]",
        "[fia.int8nz.heads]",
        "[npu.offsets]",
    ):
        assert rule in text
    assert text.count("torch_npu 26.0.0") == 5
    ok = AttentionSpec(
        op="decode",
        mode="int8_kv",
        query_dtype=torch.bfloat16,
        cache_dtype=torch.int8,
        head_dim=128,
        num_heads=64,
        num_kv_heads=8,
        block_size=128,
        layout="nz",
        device_type="npu",
    )
    assert NPUBackend(release="7.2.0").unsupported_reasons(ok) == []
    (reason,) = NPUBackend(release="7.1.0").unsupported_reasons(ok)
    assert "[route.decode.int8_kv.nz]" in reason and "7.1.0" in reason
    npu = NPUBackend()
    assert npu.release == "26.0.0"  # no torch_npu loaded: the newest release
    assert npu.preferred_layout("faquant") == "nd"
    assert npu.preferred_layout("float") == "nd"
    assert npu.preferred_layout("float", mla=True) == "nz"
    assert npu.preferred_layout("int8_kv") == "nz"
    with pytest.raises(ValueError, match="unknown torch_npu release"):
        NPUBackend(release="7.0.0")


def test_kv_cache_shape():
    cpu = get_backend("cpu")
    assert cpu.kv_cache_shape(4, 128, 8, 128, torch.int8) == (4, 32, 128, 32)
    assert cpu.kv_cache_shape(4, 128, 8, 128, torch.int8, layout="nd") == (
        4,
        128,
        8,
        128,
    )
    with pytest.raises(ValueError, match=r"layout must be one of"):
        cpu.kv_cache_shape(4, 128, 8, 128, torch.int8, layout="zz")


def test_backend_for_device():
    assert backend_for_device(torch.device("cpu")).name == "cpu"
    assert backend_for_device("cpu").name == "cpu"
    with pytest.raises(ValueError, match=r"no usable backend for tensors on 'npu'"):
        backend_for_device("npu")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Install a third-party backend through a real entry point: a dist-info with
    entry_points.txt on sys.path, as an installed wheel would leave it."""
    pkg = tmp_path / "fa_test_plugin.py"
    pkg.write_text(
        textwrap.dedent("""
        from ascend_fa.backends import Availability, Backend

        class ToyBackend(Backend):
            name = "toy"
            device_type = "cpu"
            priority = 50

            @classmethod
            def is_available(cls):
                return Availability(True)

        class BrokenBackend(Backend):
            name = "broken"
            device_type = "cpu"

            @classmethod
            def is_available(cls):
                return Availability(False, "needs the toy accelerator")
    """)
    )
    dist = tmp_path / "fa_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fa-test-plugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[ascend_fa.backends]\n"
        "toy = fa_test_plugin:ToyBackend\n"
        "broken = fa_test_plugin:BrokenBackend\n"
        "missing = fa_test_plugin_nonexistent:Nope\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("fa_test_plugin", None)


def test_entry_point_plugin_discovery(plugin, monkeypatch):
    infos = {i.name: i for i in list_backends()}
    assert infos["toy"].available
    assert infos["toy"].source == "entry point ascend_fa.backends"
    assert not infos["broken"].available and "toy accelerator" in infos["broken"].reason
    assert not infos["missing"].available and "cannot load" in infos["missing"].reason
    assert get_backend("toy").name == "toy"
    monkeypatch.setenv("ASCEND_FA_BACKEND", "toy")
    assert get_backend().name == "toy"
    with pytest.raises(ValueError, match=r"needs the toy accelerator"):
        get_backend("broken")
    # lower priority than cpu: automatic selection still picks a built-in
    monkeypatch.delenv("ASCEND_FA_BACKEND")
    assert get_backend().name in ("cpu", "cuda")
