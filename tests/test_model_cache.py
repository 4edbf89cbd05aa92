"""The GGUF model cache: bit-identical to a GGUF load, reused, rebuilt when corrupt."""

from __future__ import annotations

import logging

import pytest
import torch

from ascend_fa import model_cache


def test_cache_root_and_switches(tmp_path, monkeypatch):
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "c"))
    assert model_cache.cache_root() == tmp_path / "c"
    monkeypatch.delenv(model_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert model_cache.cache_root() == tmp_path / "x" / "ascend-fa"
    monkeypatch.setenv(model_cache.NO_CACHE_ENV, "1")
    assert not model_cache.cache_enabled(True)
    monkeypatch.setenv(model_cache.NO_CACHE_ENV, "0")
    assert model_cache.cache_enabled(True) and not model_cache.cache_enabled(False)


def test_entry_validation(tmp_path):
    """A hand-made entry is valid only with a matching manifest and intact files."""
    import hashlib
    import json

    from ascend_fa import __version__

    entry = tmp_path / "e"
    entry.mkdir()
    (entry / "a.bin").write_bytes(b"abc")
    digest = "d" * 64
    meta = {
        "format": "ascend-fa-gguf-cache/1",
        "version": __version__,
        "gguf_sha256": digest,
        "files": {"a.bin": {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}},
    }
    (entry / model_cache.MANIFEST_NAME).write_text(json.dumps(meta))
    assert model_cache.valid_entry(entry, digest)
    assert not model_cache.valid_entry(entry, "e" * 64)  # another GGUF
    (entry / "a.bin").write_bytes(b"abd")  # same size, other bytes
    assert not model_cache.valid_entry(entry, digest)
    (entry / "a.bin").write_bytes(b"ab")  # truncated
    assert not model_cache.valid_entry(entry, digest)
    (entry / model_cache.MANIFEST_NAME).write_text("[1, 2]")  # not an object
    assert not model_cache.valid_entry(entry, digest)
    for bad in ({"../x": {"size": 1, "sha256": ""}}, {}):
        meta["files"] = bad
        (entry / model_cache.MANIFEST_NAME).write_text(json.dumps(meta))
        assert not model_cache.valid_entry(entry, digest)


@pytest.mark.slow
def test_smollm2_cache_is_bit_identical_and_rebuilt(tmp_path, monkeypatch, caplog):
    pytest.importorskip("gguf")
    from ascend_fa.models import ModelNotFoundError, load_model

    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    try:
        ref = load_model(cache=False)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    text = "The lighthouse keeper climbed the stairs.\n\ndef f(x): return x"
    ref_sd = ref.model.state_dict()
    ref_ids = ref.tokenizer(text)["input_ids"]
    del ref

    def check(loaded):
        sd = loaded.model.state_dict()
        assert sd.keys() == ref_sd.keys()
        for k, v in sd.items():
            assert v.dtype == ref_sd[k].dtype and torch.equal(v, ref_sd[k]), k
        assert loaded.tokenizer(text)["input_ids"] == ref_ids
        assert loaded.gguf_file is not None  # still reported as the GGUF source

    check(load_model())  # builds the entry
    (entry,) = (tmp_path / "cache" / "models").iterdir()
    assert (entry / model_cache.MANIFEST_NAME).is_file()
    check(load_model())  # reuses it
    weights = next(entry.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ascend_fa.model_cache"):
        check(load_model())
    assert any("corrupt; rebuilding" in r.getMessage() for r in caplog.records)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [entry.name]
