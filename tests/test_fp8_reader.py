"""CheckpointReader: one tensor at a time, FP8 block weights dequantized on the fly,
bit-equal to loading the ``fp8 dequantize`` output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_fp8 import (
    DEFAULT_SELECTED,
    assert_bit_equal,
    flat,
    make_bf16_checkpoint,
    make_fp8_checkpoint,
    naive_dequantize,
)

from ascend_fa.errors import FileFormatError, NotFoundError
from ascend_fa.fp8 import CheckpointReader, dequantize_checkpoint

SHARD1 = "model-00001-of-00003.safetensors"


@pytest.mark.parametrize("exact", [True, False])
def test_reader_equals_dequantize_output_bit_for_bit(tmp_path, exact):
    src = make_fp8_checkpoint(tmp_path / "fp8", exact_scales=exact)
    reader = CheckpointReader(tmp_path / "fp8")
    assert reader.is_fp8 and reader.block_size == (128, 128)
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        out = tmp_path / f"deq-{name}"
        dequantize_checkpoint(tmp_path / "fp8", out, dtype=name, progress=False)
        ref = flat(out)
        assert reader.names() == sorted(ref)  # scales are not listed
        for n, t in ref.items():
            got = reader.tensor(n, dtype if n in DEFAULT_SELECTED else None)
            assert_bit_equal(got, t)
    # and both equal the naive per-block reference
    n = DEFAULT_SELECTED[0]
    assert_bit_equal(
        reader.tensor(n),
        naive_dequantize(src[n], src[n + "_scale_inv"], torch.bfloat16),
    )


def test_metadata_and_casts(tmp_path):
    make_fp8_checkpoint(tmp_path / "fp8")
    reader = CheckpointReader(tmp_path / "fp8")
    w = "model.layers.0.self_attn.q_a_proj.weight"
    info = reader.metadata(w)
    assert info.fp8 and info.dtype == torch.bfloat16 and info.stored_dtype == "F8_E4M3"
    assert info.shape == (200, 300) and info.shard == SHARD1
    assert w in reader and w + "_scale_inv" not in reader
    # other dtypes are a cast of the bfloat16 result
    assert_bit_equal(reader.tensor(w, torch.float32), reader.tensor(w).float())
    norm = reader.metadata("model.norm.weight")
    assert not norm.fp8 and norm.dtype == torch.bfloat16
    assert reader.tensor("model.norm.weight", torch.float32).dtype == torch.float32
    with pytest.raises(NotFoundError, match="'nope' is not in the checkpoint"):
        reader.tensor("nope")
    with pytest.raises(NotFoundError):
        reader.metadata(w + "_scale_inv")


def test_reads_only_the_tensor_asked_for(tmp_path):
    """A NaN code in another weight does not matter until that weight is read."""
    make_fp8_checkpoint(tmp_path / "fp8")
    shard = tmp_path / "fp8" / SHARD1
    with safe_open(str(shard), framework="pt") as h:
        ts = {k: h.get_tensor(k) for k in h.keys()}
    bad = "model.layers.0.mlp.up_proj.weight"
    ts[bad].view(torch.uint8)[3, 5] = 0x7F
    save_file(ts, str(shard), metadata={"format": "pt"})
    reader = CheckpointReader(tmp_path / "fp8")
    reader.tensor("model.layers.0.mlp.gate_proj.weight")
    with pytest.raises(FileFormatError, match=rf"{SHARD1}.*'{bad}'.*NaN code"):
        reader.tensor(bad)


def test_plain_checkpoint_passes_through(tmp_path):
    src = make_bf16_checkpoint(tmp_path / "bf16")
    reader = CheckpointReader(tmp_path / "bf16")
    assert not reader.is_fp8
    assert reader.names() == sorted(src)
    for n, t in src.items():
        assert_bit_equal(reader.tensor(n), t)


def test_fp8_without_scale_and_bad_config_are_refused(tmp_path):
    make_fp8_checkpoint(tmp_path / "fp8")
    shard = tmp_path / "fp8" / SHARD1
    with safe_open(str(shard), framework="pt") as h:
        ts = {k: h.get_tensor(k) for k in h.keys()}
    ts["model.extra.weight"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    save_file(ts, str(shard), metadata={"format": "pt"})
    idx = tmp_path / "fp8" / "model.safetensors.index.json"
    body = json.loads(idx.read_text())
    body["weight_map"]["model.extra.weight"] = SHARD1
    idx.write_text(json.dumps(body))
    reader = CheckpointReader(tmp_path / "fp8")
    with pytest.raises(FileFormatError, match="is FP8 but has no"):
        reader.tensor("model.extra.weight")
    cfg = tmp_path / "fp8" / "config.json"
    body = json.loads(cfg.read_text())
    body["quantization_config"]["fmt"] = "e5m2"
    cfg.write_text(json.dumps(body))
    with pytest.raises(FileFormatError, match="only 'e4m3'"):
        CheckpointReader(tmp_path / "fp8")
