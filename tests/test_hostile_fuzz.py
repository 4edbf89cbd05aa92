"""Property tests of the readers of untrusted files: whatever the bytes, the
outcome is a valid result or the library's typed error (``AscendFAError``) —
never another exception — and nothing is written.

Readers: safetensors headers and the artifact reader (index, tensor index, FA
scales, description, config, merge-target check), the model checkpoint checks
(config, index, weights), the recipe loader and the calibration data loader. Each
example runs in its own temporary directory, which must hold exactly what the
example wrote when the reader returns.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save, save_file

from ascend_fa.artifact import DESCRIPTION_FILE, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from ascend_fa.artifact.reader import (
    check_merge_target,
    read_artifact_config,
    read_description,
    read_fa_scales,
    read_tensor_index,
    weight_files,
)
from ascend_fa.calibration.data import load_calib_texts
from ascend_fa.calibration.recipe import Recipe, load_recipe
from ascend_fa.errors import AscendFAError
from ascend_fa.models import check_model_files, read_model_config
from ascend_fa.safe_files import safetensors_header

FUZZ = settings(
    max_examples=int(os.environ.get("HOSTILE_FUZZ_EXAMPLES", "60")),
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
# Names a hostile index would use, among ordinary ones.
file_names = st.sampled_from(
    [
        WEIGHTS_NAME,
        "quant_model_weights-00001-of-00002.safetensors",
        "missing.safetensors",
        "../outside.safetensors",
        "/etc/passwd",
        "sub/x.safetensors",
        "..",
        ".",
        "",
        "a\\b",
        "x\x00y",
    ]
) | st.text(max_size=10)


def _base_tensors() -> dict[str, torch.Tensor]:
    attn = "model.layers.0.self_attn"
    out = {"model.embed_tokens.weight": torch.randn(4, 3)}
    for b in ("fa_q", "fa_k", "fa_v"):
        out[f"{attn}.{b}.scale"] = torch.rand(2, 1) + 0.01
        out[f"{attn}.{b}.offset"] = torch.zeros(2, 1, dtype=torch.int8)
    return out


BASE = save(_base_tensors(), metadata={"format": "pt"})


def tree(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): (
            "-> " + os.readlink(p)
            if p.is_symlink()
            else ("dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
        )
        for p in sorted(directory.rglob("*"))
    }


@contextmanager
def sandbox():
    """A fresh directory ``root/d`` for one example; afterwards the whole of
    ``root`` must be as the example left it before calling the reader."""
    with tempfile.TemporaryDirectory() as root:
        d = Path(root) / "d"
        d.mkdir()
        yield d


def typed_or_valid(fn, *args):
    """Call ``fn``; an AscendFAError is an allowed outcome (returns None)."""
    try:
        return fn(*args)
    except AscendFAError as exc:
        assert str(exc) and "\n" not in str(exc)
        return None


def check_no_writes(directory: Path, fn, *args):
    root = directory.parent
    before = tree(root)
    result = typed_or_valid(fn, *args)
    assert tree(root) == before
    return result


# -- safetensors --------------------------------------------------------------------


@st.composite
def mutated_safetensors(draw) -> bytes:
    data = bytearray(BASE)
    n = int.from_bytes(data[:8], "little")
    kind = draw(st.sampled_from(["truncate", "flip", "header", "length", "random"]))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "length":
        fake = draw(st.integers(0, 2**64 - 1))
        return fake.to_bytes(8, "little") + bytes(data[8:])
    if kind == "random":
        return draw(st.binary(max_size=300))
    header = json.loads(data[8 : 8 + n])
    name = draw(st.sampled_from(sorted(header)))
    if name == "__metadata__":
        header[name] = draw(json_values)
    else:
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry"]))
        if field == "entry":
            header[name] = draw(json_values)
        else:
            header[name][field] = draw(
                json_values
                | st.lists(st.integers(-5, 2**40), max_size=3)
                | st.sampled_from(["F32", "I8", "BF16", "F8_E4M3", "C64", "BOOL", "F4"])
            )
    body = json.dumps(header).encode()
    return len(body).to_bytes(8, "little") + body + bytes(data[8 + n :])


@FUZZ
@given(blob=mutated_safetensors())
def test_safetensors_readers(blob):
    with sandbox() as d:
        (d / WEIGHTS_NAME).write_bytes(blob)
        header = check_no_writes(d, safetensors_header, d / WEIGHTS_NAME)
        if header is not None:
            # what we accept, safetensors itself opens
            with safe_open(str(d / WEIGHTS_NAME), framework="pt") as f:
                assert set(f.keys()) == set(header)
        index = check_no_writes(d, read_tensor_index, d)
        if index is not None:
            assert all(p.parent == d for p in index.values())
        scales = check_no_writes(d, read_fa_scales, d)
        if scales:
            for branches in scales.values():
                for scale, offset in branches.values():
                    assert scale.dtype == torch.float32 and offset.dtype == torch.int8


# -- indexes, descriptions, configs --------------------------------------------------


@FUZZ
@given(
    index=json_values
    | st.fixed_dictionaries(
        {"weight_map": st.dictionaries(st.text(max_size=6), file_names, max_size=4)}
    )
    | st.fixed_dictionaries({"weight_map": json_values})
)
def test_index_readers(index):
    with sandbox() as d:
        save_file(_base_tensors(), str(d / WEIGHTS_NAME))
        (d.parent / "outside.safetensors").write_bytes(BASE)
        (d / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
        files = check_no_writes(d, weight_files, d)
        if files is not None:
            assert all(p.parent == d for p in files)
        where = check_no_writes(d, read_tensor_index, d)
        if where is not None:
            assert all(p.parent == d for p in where.values())
        check_no_writes(d, check_merge_target, d)


@FUZZ
@given(desc=json_values, config=json_values)
def test_description_and_config_readers(desc, config):
    with sandbox() as d:
        save_file({"model.embed_tokens.weight": torch.zeros(2)}, str(d / WEIGHTS_NAME))
        (d / DESCRIPTION_FILE).write_text(json.dumps(desc))
        (d / "config.json").write_text(json.dumps(config))
        got = check_no_writes(d, read_description, d)
        if got is not None:
            assert isinstance(got, dict)
        cfg = check_no_writes(d, read_artifact_config, d)
        assert cfg is None or isinstance(cfg, dict)
        check_no_writes(d, check_merge_target, d)


@FUZZ
@given(
    config=json_values
    | st.fixed_dictionaries({"model_type": json_values, "dtype": json_values}),
    raw=st.none() | st.binary(max_size=64),
)
def test_model_config_and_checkpoint_checks(config, raw):
    with sandbox() as d:
        if raw is None:
            (d / "config.json").write_text(json.dumps(config))
        else:
            (d / "config.json").write_bytes(raw)
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
        cfg = check_no_writes(d, read_model_config, d)
        assert cfg is None or isinstance(cfg, dict)
        check_no_writes(d, check_model_files, d)


@FUZZ
@given(
    index=json_values
    | st.fixed_dictionaries(
        {"weight_map": st.dictionaries(st.text(max_size=6), file_names, max_size=4)}
    ),
    blob=mutated_safetensors(),
)
def test_model_index_and_weights_checks(index, blob):
    with sandbox() as d:
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / WEIGHTS_NAME).write_bytes(blob)
        (d / "model.safetensors").write_bytes(blob)
        check_no_writes(d, check_model_files, d)


# -- recipes and calibration data ----------------------------------------------------

YAML_BITS = st.sampled_from(
    [
        "spec:",
        "  process:",
        "    - type: fa3_quant",
        "      include: [",
        '"*"',
        "]",
        "{a,b}",
        "&a ",
        "*a",
        "<<: ",
        "ratio: ",
        "0.5",
        "method: minmax",
        "accumulate: pooled",
        "max_samples: 10",
        "fa_q: {ratio: 2}",
        "!!python/object:os.system",
        "[[[[",
        "---",
        "\t",
        "? ",
        ": ",
        "- ",
        "\n",
        "#",
    ]
)


@FUZZ
@given(
    text=st.lists(YAML_BITS, max_size=30).map("".join)
    | st.text(max_size=200)
    | json_values.map(lambda v: yaml.safe_dump({"spec": {"process": [v]}}))
    | json_values.map(lambda v: yaml.safe_dump({"spec": v}))
)
def test_recipe_loader(text):
    with sandbox() as d:
        path = d / "r.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        got = check_no_writes(d, load_recipe, path)
        assert got is None or isinstance(got, Recipe)
        if "\n" in text:  # the same document given as text
            typed_or_valid(load_recipe, text)


@FUZZ
@given(
    raw=st.binary(max_size=200)
    | st.lists(json_values.map(json.dumps), max_size=5).map("\n".join).map(str.encode)
    | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    suffix=st.sampled_from([".jsonl", ".txt", ".json", ""]),
)
def test_calibration_data_loader(raw, suffix):
    with sandbox() as d:
        path = d / f"calib{suffix}"
        path.write_bytes(raw)
        got = check_no_writes(d, load_calib_texts, path)
        if got is not None:
            assert got and all(isinstance(t, str) and t.strip() for t in got)


def test_fuzz_sandbox_sees_writes():
    """The no-write check would notice a write (guards the guard)."""
    with sandbox() as d:

        def writer(_d):
            (_d / "new").write_text("x")

        with pytest.raises(AssertionError):
            check_no_writes(d, writer, d)
