"""``calibrate --streaming``: one decoder layer in memory, the same artifact.

Real tiny checkpoints saved by transformers in several safetensors shards (BF16),
a DeepSeek FP8 block checkpoint made by ``fp8 quantize``; each streamed artifact
is compared with the whole-model artifact of the same arguments: every tensor
byte-identical, the shard index, description and config equal (the report
differs only in its timings).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import DEEPSEEK_TINY, byte_tokenizer, tiny_causal_lm
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ascend_fa.artifact import (
    WEIGHTS_INDEX_NAME,
    LazyTensors,
    TensorSpec,
    write_safetensors,
)
from ascend_fa.calibration.job import calibrate
from ascend_fa.cli import main
from ascend_fa.errors import InputError

TEXTS = [
    f"Sample {i}: the quick brown fox jumps over {i * 7} lazy dogs; print(x[{i}])"
    for i in range(8)
]
GQA = dict(
    vocab_size=260,
    max_position_embeddings=128,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
)


def _checkpoint(path: Path, model_type: str, **over) -> Path:
    """A BF16 checkpoint in several shards (and the byte tokenizer)."""
    if model_type == "deepseek_v3":
        cfg = dict(vocab_size=260, max_position_embeddings=128, **DEEPSEEK_TINY)
    else:
        cfg = dict(GQA)
    cfg.update(over)
    model = tiny_causal_lm(model_type, attn=None, **cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="30KB")
    byte_tokenizer().save_pretrained(path)
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def _add_mtp(src: Path) -> list[str]:
    """An MTP layer ``model.layers.<N>.*`` in its own shard, as the official
    DeepSeek-V3 checkpoint has one: layer N-1's tensors plus ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm``."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    config = json.loads((src / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    last = f"model.layers.{n - 1}."
    mtp: dict[str, torch.Tensor] = {}
    for name, shard in index["weight_map"].items():
        if name.startswith(last):
            t = load_file(str(src / shard))[name]
            mtp[f"model.layers.{n}." + name[len(last) :]] = t.clone()
    gen = torch.Generator().manual_seed(1)
    for part, shape in (
        ("enorm.weight", [hidden]),
        ("hnorm.weight", [hidden]),
        ("eh_proj.weight", [hidden, 2 * hidden]),
        ("shared_head.norm.weight", [hidden]),
    ):
        mtp[f"model.layers.{n}.{part}"] = torch.randn(shape, generator=gen).to(
            torch.bfloat16
        )
    save_file(mtp, str(src / "model-mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    config["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(config))
    return sorted(mtp)


def _data(tmp_path: Path) -> Path:
    p = tmp_path / "calib.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return p


def _run(src: Path, out: Path, tmp_path: Path, **kw):
    args = dict(
        calib_data=_data(tmp_path),
        num_samples=4,
        max_length=24,
        batch_size=2,
        heldout=2,
        picture_report=False,
        progress=False,
    )
    return calibrate(src, output=out, **{**args, **kw})


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def _assert_same_artifact(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert list(ta) and set(ta) == set(tb)
    for name, t in ta.items():
        u = tb[name]
        assert t.dtype == u.dtype and t.shape == u.shape, name
        assert torch.equal(
            t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)
        ), name
    for f in ("config.json", WEIGHTS_INDEX_NAME):
        if (a / f).exists() or (b / f).exists():
            assert (a / f).read_text() == (b / f).read_text(), f
    da, db = a / "quant_model_description.json", b / "quant_model_description.json"
    if da.exists() or db.exists():
        assert da.read_text() == db.read_text()
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    ra = json.loads((a / "calibration_report.json").read_text())
    rb = json.loads((b / "calibration_report.json").read_text())
    assert ra["heldout"] == rb["heldout"] and ra["layers"] == rb["layers"]


def test_streaming_gqa_tied_equals_whole_model(tmp_path):
    """Tied Llama, float linears, C8 KV scales for vllm-ascend: bit-equal; the
    spill directory is gone afterwards."""
    src = _checkpoint(tmp_path / "src", "llama")
    kw = dict(target="vllm-ascend", linear="none", max_shard_size="40KB")
    kw["consumer_version"] = "0.25.1rc1"  # Llama C8 loads from 0.25.1rc1 on
    whole = _run(src, tmp_path / "whole", tmp_path, **kw)
    streamed = _run(src, tmp_path / "stream", tmp_path, streaming=True, **kw)
    _assert_same_artifact(whole.output, streamed.output)
    assert (whole.output / WEIGHTS_INDEX_NAME).exists()
    assert not list(tmp_path.glob(".*streaming*"))


@pytest.mark.slow
def test_streaming_w8a8_equals_whole_model(tmp_path):
    """W8A8 linears (smoothing, clipping, layer-local fallback), FAQuant scales for
    MindIE: the streamed run spills each changed layer and gives the same bits.
    A streaming run does not rotate the residual stream (``--rotate auto``), so
    the whole-model run it equals is the one with ``--rotate off``."""
    src = _checkpoint(tmp_path / "src", "qwen2", num_hidden_layers=2)
    kw = dict(target="mindie", linear="w8a8", linear_fallback=2, max_length=16)
    whole = _run(src, tmp_path / "whole", tmp_path, rotate="off", **kw)
    streamed = _run(src, tmp_path / "stream", tmp_path, streaming=True, **kw)
    _assert_same_artifact(whole.output, streamed.output)
    rep = json.loads((streamed.output / "calibration_report.json").read_text())
    assert rep["linears"]["criterion"] == "layer"


@pytest.mark.slow
def test_streaming_deepseek_fp8_source_equals_dequantized_whole_model(tmp_path):
    """DeepSeek-V3 (dense first layer, routed + shared experts, MLA, an MTP layer)
    stored as FP8 blocks: streaming from the FP8 shards == the whole-model path on
    the ``fp8 dequantize`` copy, MTP tensors carried through."""
    from ascend_fa.fp8 import dequantize_checkpoint, quantize_checkpoint

    src = _checkpoint(tmp_path / "src", "deepseek_v3", num_hidden_layers=3)
    mtp = _add_mtp(src)
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(src, fp8, progress=False)
    byte_tokenizer().save_pretrained(fp8)
    deq = tmp_path / "deq"
    dequantize_checkpoint(fp8, deq, progress=False)
    byte_tokenizer().save_pretrained(deq)
    kw = dict(target="vllm-ascend", linear="w8a8_dynamic", max_length=16)
    whole = _run(deq, tmp_path / "whole", tmp_path, **kw)
    streamed = _run(fp8, tmp_path / "stream", tmp_path, streaming=True, **kw)
    _assert_same_artifact(whole.output, streamed.output)
    written = _tensors(streamed.output)
    experts = [n for n in written if ".mlp.experts.3." in n]
    assert experts, "routed experts are written per expert, as in the checkpoint"
    assert written["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.int8
    # the MTP layer is carried through (not calibrated: no module runs it)
    desc = json.loads((streamed.output / "quant_model_description.json").read_text())
    assert set(mtp) <= set(written)
    assert {desc[n] for n in mtp} == {"FLOAT"}
    deq_mtp = _tensors(deq)
    for name in mtp:
        assert torch.equal(written[name], deq_mtp[name]), name


def _cli(src: Path, out: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "calibrate",
        "--model",
        str(src),
        "--calib-data",
        str(_data(tmp_path)),
        "--num-samples",
        "4",
        "--max-length",
        "16",
        "--heldout",
        "0",
        "--target",
        "vllm-ascend",
        "--consumer-version",
        "0.25.1rc1",  # Llama C8 loads from 0.25.1rc1 on
        "--linear",
        "none",
        "--output",
        str(out),
        "--streaming",
        *extra,
    ]


def _index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def test_bad_shards_end_in_one_line_naming_the_file(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=2)
    capsys.readouterr()  # the checkpoint writer's progress
    out = tmp_path / "out"
    index = _index(src)
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]

    # a layer whose tensor disagrees with the config
    tensors = load_file(str(src / shard))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(
        7, 48, dtype=torch.bfloat16
    )
    save_file(tensors, str(src / shard), metadata={"format": "pt"})
    assert main(_cli(src, out, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and shard in err and "[7, 48]" in err
    assert not out.exists()

    # an index naming a tensor its shard does not hold
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(src / shard), metadata={"format": "pt"})
    assert main(_cli(src, out, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.layers.1.mlp.up_proj.weight" in err
    assert not out.exists()

    # a shard missing
    (src / shard).unlink()
    assert main(_cli(src, out, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and shard in err
    assert not out.exists()
    assert not list(tmp_path.glob(".*streaming*"))


def test_a_tensor_the_model_needs_is_missing(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=2)
    capsys.readouterr()  # the checkpoint writer's progress
    index = _index(src)
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = index["weight_map"].pop(name)
    tensors = load_file(str(src / shard))
    del tensors[name]
    save_file(tensors, str(src / shard), metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    assert main(_cli(src, out, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err
    assert "model.safetensors.index.json" in err
    assert not out.exists()


def test_streaming_refusals(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=2)
    capsys.readouterr()  # the checkpoint writer's progress
    out = tmp_path / "out"
    cases = [
        (
            ["--linear", "w8a8", "--target", "mindie", "--consumer-version", "3.0.0"]
            + ["--linear-fallback-criterion", "kl"],
            "--linear-fallback-criterion kl",
        ),
        (["--max-memory", "1MB"], "more than --max-memory"),
        (["--max-memory", "lots"], "lots"),
    ]
    for extra, message in cases:
        assert main(_cli(src, out, tmp_path, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
        assert not out.exists()
    whole = [a for a in _cli(src, out, tmp_path) if a != "--streaming"]
    assert main([*whole, "--max-memory", "8GB"]) == 2
    assert "--max-memory bounds a --streaming run" in capsys.readouterr().err
    with pytest.raises(InputError, match="checkpoint directory"):
        calibrate(None, output=out, streaming=True, linear="none", target="vllm")


def test_lazy_tensors_write_readable_safetensors(tmp_path):
    """One tensor in memory at a time; safetensors reads the file back exactly."""
    want = {
        "b": torch.arange(6, dtype=torch.int8).reshape(2, 3),
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.tensor([1.5], dtype=torch.float32),
        "d": torch.arange(4, dtype=torch.int32),
    }
    loads: list[str] = []

    def load(name: str) -> torch.Tensor:
        loads.append(name)
        return want[name]

    lazy = LazyTensors(
        {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in want.items() if n != "d"},
        load,
    ).with_extra({"d": want["d"]})
    assert list(lazy) == ["b", "a", "c", "d"] and loads == []
    write_safetensors(tmp_path / "x.safetensors", lazy, list(lazy), {"format": "pt"})
    assert loads == ["b", "a", "c"]
    got = load_file(str(tmp_path / "x.safetensors"))
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t)
    bad = LazyTensors({"a": TensorSpec((3, 4), torch.bfloat16)}, load)
    with pytest.raises(RuntimeError, match="planned"):
        bad["a"]


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", "llama", num_hidden_layers=2)
    capsys.readouterr()  # the checkpoint writer's progress
    out = tmp_path / "out"
    assert main(_cli(src, out, tmp_path, "--dry-run")) == 0
    printed = capsys.readouterr().out
    assert "plan: 2 decoder layers" in printed
    assert "  layer 1: " in printed and ".safetensors" in printed
    assert (
        "peak memory estimate" in printed and "disk: spill at most 0.00 GiB" in printed
    )
    assert not out.exists() and not list(tmp_path.glob(".*streaming*"))
    whole = [a for a in _cli(src, out, tmp_path, "--dry-run") if a != "--streaming"]
    assert main(whole) == 2
    assert "--dry-run plans a --streaming run" in capsys.readouterr().err
