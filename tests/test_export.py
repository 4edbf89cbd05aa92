"""Artifact export: format, round trip, shards, tied weights, merge, atomicity."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from builders import scale_map
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ascend_fa import artifact as export
from ascend_fa.artifact import (
    DESCRIPTION_FILE,
    FA_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    build_description,
    checkpoint_state_dict,
    export_artifact,
    fa_tensors,
    inspect_artifact,
    merge_into,
    parse_size,
    read_fa_scales,
)

ATTN = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def make_scales(heads=(6, 2, 2), seed=0):
    return scale_map(ATTN, heads, seed)


#: The tiny LLaMA the synthetic artifacts of this file describe: 6 query heads and
#: 2 KV heads of width 4 (the scales' head counts), tied embeddings; config.json
#: says so, so the artifact is complete against the architecture it names.
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 24,
    "head_dim": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "vocab_size": 50,
    "tie_word_embeddings": True,
}
#: [out, in] of each linear of TINY_LLAMA's layers
LINEAR_SHAPES = {
    "self_attn.q_proj": (24, 24),
    "self_attn.k_proj": (8, 24),
    "self_attn.v_proj": (8, 24),
    "self_attn.o_proj": (24, 24),
    "mlp.gate_proj": (32, 24),
    "mlp.up_proj": (32, 24),
    "mlp.down_proj": (24, 32),
}


def make_state(seed=0):
    """Every float tensor of TINY_LLAMA."""
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(50, 24, generator=g)}
    for i in range(2):
        for p, shape in LINEAR_SHAPES.items():
            sd[f"model.layers.{i}.{p}.weight"] = torch.randn(*shape, generator=g)
        for n in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{n}.weight"] = torch.ones(24)
    sd["model.norm.weight"] = torch.ones(24)
    return sd


def test_fa_tensors_format():
    t = fa_tensors(make_scales())
    assert len(t) == 2 * 3 * 2
    s = t["model.layers.0.self_attn.fa_q.scale"]
    o = t["model.layers.1.self_attn.fa_k.offset"]
    assert s.dtype == torch.float32 and s.shape == (6, 1)
    assert o.dtype == torch.int8 and o.shape == (2, 1) and not o.any()
    bad = make_scales()
    bad[ATTN[0]]["fa_k"] = (torch.tensor([0.1, -1.0]), torch.zeros(2, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"fa_k.scale must be finite and > 0"):
        fa_tensors(bad)
    bad[ATTN[0]]["fa_k"] = (torch.tensor([0.1, 0.1]), torch.ones(2, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"fa_k.offset must be zeros"):
        fa_tensors(bad)
    del bad[ATTN[0]]["fa_k"]
    with pytest.raises(ValueError, match=r"missing FA branches \['fa_k'\]"):
        fa_tensors(bad)


def test_description_entries():
    d = build_description(["a.weight", "b.weight"], make_scales(), "FAQuant")
    assert d["model_quant_type"] == "FLOAT" and d["fa_quant_type"] == "FAQuant"
    assert d["version"] == export.DESCRIPTION_VERSION
    assert d["a.weight"] == "FLOAT"
    assert d["model.layers.1.self_attn.quant_type"] == "INT8"
    assert d["model.layers.1.self_attn.fa_v.offset"] == "FAQuant"
    assert len(d) == 3 + 2 + 2 * (1 + 6)
    with pytest.raises(ValueError, match="fa_quant_type must be FAQuant or FAKQuant"):
        build_description([], {}, "W8A8")


def test_round_trip_bit_equal(tmp_path):
    scales, sd = make_scales(), make_state()
    out = export_artifact(
        tmp_path / "art",
        state_dict=sd,
        scales=scales,
        fa_quant_type="FAQuant",
        config=TINY_LLAMA,
        report={"x": 1},
    )
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["config.json", DESCRIPTION_FILE, WEIGHTS_NAME, "calibration_report.json"]
    )
    back = read_fa_scales(out)
    assert back.keys() == scales.keys()
    for a in scales:
        for b in ("fa_q", "fa_k", "fa_v"):
            assert torch.equal(back[a][b][0], scales[a][b][0])  # bit-equal fp32
            assert back[a][b][1].dtype == torch.int8 and not back[a][b][1].any()
    weights = load_file(str(out / WEIGHTS_NAME))
    for k, v in sd.items():
        assert torch.equal(weights[k], v)
    cfg = json.loads((out / "config.json").read_text())
    # vLLM's get_quant_config would take a quantization_config as the whole
    # description; msModelSlim's saver removes it. torch_dtype is always set.
    assert "quantization_config" not in cfg
    assert cfg["torch_dtype"] == "float32"
    result = inspect_artifact(out)
    assert result["valid"], result["findings"]
    assert result["summary"]["fa_modules"] == 2
    assert (out.stat().st_mode & 0o777) != 0o700  # not mkdtemp's private mode


def test_sharding_and_index(tmp_path):
    sd = make_state()
    out = export_artifact(
        tmp_path / "art",
        state_dict=sd,
        scales=make_scales(),
        fa_quant_type="FAQuant",
        max_shard_size="2KB",
    )
    index = json.loads((out / WEIGHTS_INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / WEIGHTS_NAME).exists()
    assert files[0] == f"quant_model_weights-00001-of-{len(files):05d}.safetensors"
    total = 0
    for f in files:
        with safe_open(str(out / f), framework="pt") as h:
            size = 0
            for k in h.keys():
                t = h.get_tensor(k)
                size += t.numel() * t.element_size()
                assert index["weight_map"][k] == f
            # a shard is over the limit only when a single tensor is
            assert size <= 2000 or len(list(h.keys())) == 1
            total += size
    assert index["metadata"]["total_size"] == total
    assert len(index["weight_map"]) == len(sd) + 12
    assert inspect_artifact(out)["valid"]
    assert read_fa_scales(out).keys() == set(ATTN)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500 MiB") == 500 * 2**20
    assert parse_size("1.5kb") == 1500
    assert parse_size(1024) == 1024
    with pytest.raises(ValueError, match="cannot parse size 'five'"):
        parse_size("five")
    with pytest.raises(ValueError, match="shard size must be > 0"):
        parse_size(0)


def test_tied_weights_skipped(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = checkpoint_state_dict(model, torch.bfloat16)
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    # safetensors accepts it (no shared storage left)
    export_artifact(
        tmp_path / "a",
        state_dict=sd,
        scales=make_scales((2, 2, 2)),
        fa_quant_type="FAQuant",
    )
    # untied model keeps lm_head; an aliased non-tied tensor is cloned
    cfg.tie_word_embeddings = False
    model = transformers.LlamaForCausalLM(cfg)
    model.model.norm.weight = model.model.layers[0].input_layernorm.weight
    sd = checkpoint_state_dict(model)
    assert "lm_head.weight" in sd
    a, b = sd["model.norm.weight"], sd["model.layers.0.input_layernorm.weight"]
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_read_accepts_head_dim_expanded_scales(tmp_path):
    d = tmp_path / "ms"
    d.mkdir()
    q = torch.tensor([0.5, 0.25]).repeat_interleave(8).view(2, 8).half()
    tensors = {
        "m.fa_q.scale": q,
        "m.fa_q.offset": torch.zeros(2, 8).half(),
        "m.fa_k.scale": q[:1].float(),
        "m.fa_k.offset": torch.zeros(1, 8),
        "m.fa_v.scale": q[:1, :1].float(),
        "m.fa_v.offset": torch.zeros(1, 1),
    }
    save_file(tensors, str(d / "quant_model_weight_w8a8.safetensors"))
    s = read_fa_scales(d)
    assert torch.equal(s["m"]["fa_q"][0], torch.tensor([0.5, 0.25]))
    assert s["m"]["fa_q"][0].dtype == torch.float32
    assert s["m"]["fa_v"][1].dtype == torch.int8
    tensors["m.fa_q.scale"] = torch.arange(16.0).view(2, 8)
    save_file(tensors, str(d / "quant_model_weight_w8a8.safetensors"))
    with pytest.raises(ValueError, match=r"m.fa_q.scale \(2, 8\) varies along"):
        read_fa_scales(d)
    del tensors["m.fa_q.offset"]
    tensors["m.fa_q.scale"] = q
    save_file(tensors, str(d / "quant_model_weight_w8a8.safetensors"))
    with pytest.raises(ValueError, match=r"m.fa_q: scale and offset tensors are both"):
        read_fa_scales(d)


def _msmodelslim_dir(path, sharded=False):
    """A synthetic msModelSlim W8A8 export (seed 003 layout)."""
    path.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors, desc = {}, {"model_quant_type": "W8A8", "version": "1.0.0"}
    tensors["model.embed_tokens.weight"] = torch.randn(50, 24, generator=g).half()
    desc["model.embed_tokens.weight"] = "FLOAT"
    for i in range(2):
        layer = f"model.layers.{i}"
        for p, (rows, cols) in LINEAR_SHAPES.items():
            n = f"{layer}.{p}"
            tensors[f"{n}.weight"] = torch.randint(
                -128, 127, (rows, cols), dtype=torch.int8, generator=g
            )
            tensors[f"{n}.input_scale"] = torch.rand(1, generator=g).half()
            tensors[f"{n}.input_offset"] = torch.zeros(1).half()
            tensors[f"{n}.quant_bias"] = torch.randint(
                -9, 9, (rows,), dtype=torch.int32, generator=g
            )
            tensors[f"{n}.deq_scale"] = torch.rand(rows, generator=g)
            for k in (
                "weight",
                "input_scale",
                "input_offset",
                "quant_bias",
                "deq_scale",
            ):
                desc[f"{n}.{k}"] = "W8A8"
        for n in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{layer}.{n}.weight"] = torch.ones(24).half()
            desc[f"{layer}.{n}.weight"] = "FLOAT"
    tensors["model.norm.weight"] = torch.ones(24).half()
    desc["model.norm.weight"] = "FLOAT"
    if sharded:
        names = sorted(tensors)
        half = len(names) // 2
        wm = {}
        for i, part in enumerate((names[:half], names[half:]), start=1):
            f = f"quant_model_weights-0000{i}-of-00002.safetensors"
            save_file({k: tensors[k] for k in part}, str(path / f))
            wm.update(dict.fromkeys(part, f))
        (path / WEIGHTS_INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": 123}, "weight_map": wm})
        )
    else:
        save_file(tensors, str(path / "quant_model_weight_w8a8.safetensors"))
    (path / DESCRIPTION_FILE).write_text(json.dumps(desc, indent=1))
    (path / "config.json").write_text(
        json.dumps({**TINY_LLAMA, "quantization_config": {"quant_method": "w8a8"}})
    )
    (path / "tokenizer.json").write_text("{}")
    return tensors, desc


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


@pytest.mark.parametrize("sharded", [False, True])
def test_merge_into_keeps_every_entry_and_byte(tmp_path, sharded):
    src = tmp_path / "w8a8"
    tensors, desc = _msmodelslim_dir(src, sharded)
    before = _digests(src)
    # the export's only fault is the quantization_config the merge removes
    (finding,) = inspect_artifact(src)["findings"]
    assert finding.startswith("config.json: quantization_config present")
    scales = make_scales()
    out = merge_into(
        src,
        scales=scales,
        fa_quant_type="FAQuant",
        output=tmp_path / "merged",
        report={"r": 1},
    )
    assert _digests(src) == before  # source untouched
    after = _digests(out)
    changed = {DESCRIPTION_FILE, "config.json"} | (
        {WEIGHTS_INDEX_NAME} if sharded else set()
    )
    for name, digest in before.items():
        if name not in changed:
            assert after[name] == digest, name  # existing weights byte for byte
    assert FA_WEIGHTS_NAME in after and "calibration_report.json" in after
    new_desc = json.loads((out / DESCRIPTION_FILE).read_text())
    for k, v in desc.items():
        assert new_desc[k] == v  # every existing entry kept
    assert new_desc["fa_quant_type"] == "FAQuant"
    assert new_desc["model_quant_type"] == "W8A8"
    assert new_desc["model.layers.0.self_attn.fa_k.scale"] == "FAQuant"
    assert new_desc["model.layers.0.self_attn.quant_type"] == "INT8"
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg  # removed, as msModelSlim's saver does
    if sharded:
        idx = json.loads((out / WEIGHTS_INDEX_NAME).read_text())
        assert (
            idx["weight_map"]["model.layers.1.self_attn.fa_v.offset"] == FA_WEIGHTS_NAME
        )
        assert idx["metadata"]["total_size"] == 123 + 2 * (10 * 4 + 10)
    result = inspect_artifact(out)
    assert result["valid"], result["findings"]
    back = read_fa_scales(out)
    for a in scales:
        for b in scales[a]:
            assert torch.equal(back[a][b][0], scales[a][b][0])
    # merging twice is refused
    with pytest.raises(ValueError, match="already has FA entries"):
        merge_into(out, scales=scales, fa_quant_type="FAQuant")


def test_merge_in_place_and_bad_targets(tmp_path):
    src = tmp_path / "w8a8"
    _msmodelslim_dir(src)
    w = (src / "quant_model_weight_w8a8.safetensors").read_bytes()
    merge_into(src, scales=make_scales(), fa_quant_type="FAQuant")
    assert (src / "quant_model_weight_w8a8.safetensors").read_bytes() == w
    assert (src / FA_WEIGHTS_NAME).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no quant_model_description.json"):
        merge_into(empty, scales=make_scales(), fa_quant_type="FAQuant")
    (empty / DESCRIPTION_FILE).write_text("{}")
    with pytest.raises(ValueError, match="model_quant_type None .* a W8A8 export"):
        merge_into(empty, scales=make_scales(), fa_quant_type="FAQuant")
    (empty / DESCRIPTION_FILE).write_text('{"model_quant_type": "W8A8"}')
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        merge_into(empty, scales=make_scales(), fa_quant_type="FAQuant")
    other = tmp_path / "other"
    _msmodelslim_dir(other)
    wrong = {"transformer.h.0.attn": make_scales()[ATTN[0]]}
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.*not in --merge-into"):
        merge_into(other, scales=wrong, fa_quant_type="FAQuant")


def test_output_exists_refused_unless_overwrite(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    kw = dict(state_dict=make_state(), scales=make_scales(), fa_quant_type="FAQuant")
    with pytest.raises(
        FileExistsError, match="exists and is not empty; pass --overwrite"
    ):
        export_artifact(out, **kw)
    assert (out / "keep.txt").read_text() == "old"
    # not an artifact of ours: --overwrite alone does not replace it
    with pytest.raises(FileExistsError, match="pass --force as well"):
        export_artifact(out, overwrite=True, **kw)
    assert (out / "keep.txt").read_text() == "old"
    export_artifact(out, overwrite=True, force=True, **kw)
    assert not (out / "keep.txt").exists() and (out / WEIGHTS_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not a directory"):
        export_artifact(tmp_path / "file", overwrite=True, **kw)


@pytest.mark.parametrize("existing", [False, True])
def test_write_failure_leaves_nothing_behind(tmp_path, monkeypatch, existing):
    out = tmp_path / "art"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("old")
    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(export.writer, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        export_artifact(
            out,
            state_dict=make_state(),
            scales=make_scales(),
            fa_quant_type="FAQuant",
            max_shard_size="2KB",
            overwrite=existing,
            force=existing,
        )
    assert len(calls) == 2  # failed mid-way, after one shard was written
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_empty_scales_refused(tmp_path):
    with pytest.raises(ValueError, match="no FA scales to export"):
        export_artifact(
            tmp_path / "a", state_dict=make_state(), scales={}, fa_quant_type="FAQuant"
        )
    assert not (tmp_path / "a").exists()
