"""Property tests: mutated safetensors headers, index files and manifests fed to
the FP8 readers. The only outcomes allowed are a valid result or a typed error
(:class:`ascend_fa.errors.AscendFAError`); nothing is written outside the temporary
directory of the example.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ascend_fa.errors import AscendFAError
from ascend_fa.fp8 import (
    CheckpointReader,
    dequantize_checkpoint,
    quantize_checkpoint,
    read_safetensors_header,
)
from ascend_fa.fp8.output import load_manifest

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=16,
)
NAMES = st.sampled_from(
    [
        "model.safetensors",
        "../model.safetensors",
        "/etc/passwd",
        "a/b.safetensors",
        "..",
        ".",
        "",
        "missing.safetensors",
        "outside.txt",
        "x\x00y",
    ]
)
DTYPES = st.sampled_from(["BF16", "F32", "F8_E4M3", "I8", "BOOL", "XX", "", "F16"])


def _valid_checkpoint(root: Path) -> dict:
    """A tiny FP8 checkpoint: one weight + scale, one bf16 tensor."""
    root.mkdir()
    tensors = {
        "w.weight": torch.full((4, 6), 0.5).to(torch.float8_e4m3fn),
        "w.weight_scale_inv": torch.full((1, 1), 0.25),
        "n.weight": torch.ones(6, dtype=torch.bfloat16),
    }
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    return tensors


def _snapshot(base: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(base)): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _outside_unchanged(base: Path, before: dict[str, bytes]) -> None:
    """Everything but ``out``/``out.partial`` is as it was."""
    after = {k: v for k, v in _snapshot(base).items() if not k.startswith("out")}
    assert after == {k: v for k, v in before.items() if not k.startswith("out")}


def _exercise(root: Path) -> None:
    """Read everything through the reader, then convert both ways."""
    try:
        reader = CheckpointReader(root)
        for name in reader.names():
            reader.metadata(name)
            reader.tensor(name)
    except AscendFAError:
        pass
    for verb in (dequantize_checkpoint, quantize_checkpoint):
        try:
            verb(root, root.parent / "out", progress=False, overwrite=True)
        except AscendFAError:
            pass


@st.composite
def mutated_header(draw) -> bytes:
    """A safetensors file whose header JSON is generated (valid-looking entries
    with hostile fields) or whose bytes are mutated."""
    data = bytearray(b"\x00" * draw(st.integers(0, 64)))
    if draw(st.booleans()):
        header = {}
        for i in range(draw(st.integers(0, 3))):
            begin = draw(st.integers(-2, 70))
            header[draw(st.text(max_size=8)) or f"t{i}"] = {
                "dtype": draw(DTYPES | JSON),
                "shape": draw(
                    st.lists(st.integers(-1, 2**64), max_size=3)
                    | st.lists(st.integers(0, 8), max_size=3)
                    | JSON
                ),
                "data_offsets": draw(
                    st.tuples(st.just(begin), st.integers(-1, 80)).map(list) | JSON
                ),
            }
        if draw(st.booleans()):
            header["__metadata__"] = draw(JSON)
        raw = json.dumps(header).encode()
    else:
        raw = json.dumps(draw(JSON)).encode()
    length = len(raw) if draw(st.booleans()) else draw(st.integers(0, 2**64 - 1))
    blob = length.to_bytes(8, "little") + raw + bytes(data)
    cut = draw(st.integers(0, len(blob)))
    return blob if draw(st.booleans()) else blob[:cut]


@FUZZ
@given(blob=mutated_header())
def test_fuzzed_safetensors_file(blob):
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        root = base / "in"
        root.mkdir()
        (root / "model.safetensors").write_bytes(blob)
        try:
            read_safetensors_header(root / "model.safetensors")
        except AscendFAError:
            pass
        before = _snapshot(base)
        _exercise(root)
        _outside_unchanged(base, before)


@FUZZ
@given(pos=st.integers(0, 10**6), byte=st.integers(0, 255), cut=st.booleans())
def test_bit_flipped_valid_file(pos, byte, cut):
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        _valid_checkpoint(base / "in")
        path = base / "in" / "model.safetensors"
        data = bytearray(path.read_bytes())
        pos %= len(data)
        if cut:
            data = data[:pos]
        else:
            data[pos] = byte
        path.write_bytes(bytes(data))
        before = _snapshot(base)
        _exercise(base / "in")
        _outside_unchanged(base, before)


@FUZZ
@given(
    index=st.one_of(
        JSON,
        st.fixed_dictionaries(
            {"weight_map": st.dictionaries(st.text(max_size=10), NAMES, max_size=4)}
        ),
        st.fixed_dictionaries(
            {
                "metadata": JSON,
                "weight_map": st.dictionaries(
                    st.sampled_from(["w.weight", "w.weight_scale_inv", "n.weight"]),
                    NAMES | JSON,
                    max_size=3,
                ),
            }
        ),
    ),
    config=st.one_of(
        st.none(),
        JSON,
        st.fixed_dictionaries(
            {
                "quantization_config": JSON
                | st.fixed_dictionaries({"weight_block_size": JSON, "fmt": JSON})
            }
        ),
    ),
)
def test_fuzzed_index_and_config(index, config):
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        _valid_checkpoint(base / "in")
        (base / "outside.txt").write_text("keep")
        (base / "in" / "model.safetensors.index.json").write_text(json.dumps(index))
        if config is None:
            (base / "in" / "config.json").unlink()
        else:
            (base / "in" / "config.json").write_text(json.dumps(config))
        before = _snapshot(base)
        _exercise(base / "in")
        _outside_unchanged(base, before)


@FUZZ
@given(
    manifest=st.one_of(
        JSON,
        st.fixed_dictionaries(
            {
                "format": st.sampled_from(
                    ["ascend-fa-fp8-manifest/1", "ascend-fa-fp8-manifest/2"]
                )
                | JSON,
                "params": st.just({"a": 1}) | JSON,
                "inputs": st.just({}) | JSON,
                "done": st.dictionaries(
                    NAMES,
                    JSON
                    | st.just({"size": 3, "sha256": "0" * 64})
                    | st.just({"size": 3, "xxh3_128": "0" * 32}),
                    max_size=3,
                )
                | JSON,
            }
        ),
    )
)
def test_fuzzed_manifest(manifest):
    with tempfile.TemporaryDirectory() as tmp:
        partial = Path(tmp) / "out.partial"
        partial.mkdir()
        (partial / ".ascend_fa_fp8_manifest.json").write_text(json.dumps(manifest))
        before = _snapshot(Path(tmp))
        try:
            done = load_manifest(partial, {"a": 1}, {}, {"model.safetensors"})
            assert set(done) <= {"model.safetensors"}
        except AscendFAError:
            pass
        assert _snapshot(Path(tmp)) == before
