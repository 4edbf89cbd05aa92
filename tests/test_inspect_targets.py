"""``inspect --target T`` judges like the consumer: exit 0 on good artifacts of
each target, exit 1 naming the tensor or key on copies broken each way."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from builders import quantize_linears, tiny_causal_lm, tiny_llama  # noqa: E402

from ascend_fa.artifact import (  # noqa: E402
    DESCRIPTION_FILE,
    WEIGHTS_NAME,
    checkpoint_tensors,
    export_artifact,
    inspect_artifact,
)
from ascend_fa.cli import main  # noqa: E402

ATTN = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
SCALE = {
    "mindie": "model.layers.0.self_attn.fa_k.scale",
    "vllm-ascend": "model.layers.0.self_attn.k_proj.kv_cache_scale",
    "vllm": "model.layers.0.self_attn.k_scale",
}


def _scales(heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        a: {
            b: (
                torch.rand(h, generator=g) * 0.1 + 1e-3,
                torch.zeros(h, dtype=torch.int8),
            )
            for b, h in zip(("fa_q", "fa_k", "fa_v"), heads, strict=True)
        }
        for a in ATTN
    }


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        a: {s: torch.rand(n, generator=g) * 0.05 + 1e-3 for s in "kv"} for a in ATTN
    }


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    out = {}
    llama = tiny_llama(tie_word_embeddings=False)  # 4 heads, 2 KV heads, D 16
    quantize_linears(llama, "W8A8")
    ckpt = checkpoint_tensors(llama, torch.bfloat16, tied_copies=True)
    out["mindie"] = export_artifact(
        root / "mindie",
        state_dict=ckpt.tensors,
        tensor_types=ckpt.types,
        scales=_scales((4, 2, 2)),
        fa_quant_type="FAQuant",
        target="mindie",
        config=llama.config.to_dict(),
        dtype=torch.bfloat16,
    )
    qwen3 = tiny_causal_lm(  # tied, 6 heads, 2 KV heads, D 8
        "qwen3",
        vocab_size=260,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    ckpt = checkpoint_tensors(qwen3, torch.bfloat16, tied_copies=True)
    out["vllm-ascend"] = export_artifact(
        root / "c8",
        state_dict=ckpt.tensors,
        tensor_types=ckpt.types,
        kv_scales=_kv(16),
        target="vllm-ascend",
        config=qwen3.config.to_dict(),
        dtype=torch.bfloat16,
    )
    plain = tiny_llama(tie_word_embeddings=False)
    ckpt = checkpoint_tensors(plain, torch.float16)
    out["vllm"] = export_artifact(
        root / "vllm",
        state_dict=ckpt.tensors,
        kv_scales=_kv(1),
        target="vllm",
        config=plain.config.to_dict(),
        dtype=torch.float16,
    )
    return out


@pytest.fixture
def copy(good, tmp_path):
    def make(target):
        dst = tmp_path / target
        shutil.copytree(good[target], dst)
        return dst

    return make


def edit_tensors(path, fn):
    t = load_file(str(path / WEIGHTS_NAME))
    fn(t)
    save_file(t, str(path / WEIGHTS_NAME))


def edit_json(path, name, fn):
    d = json.loads((path / name).read_text())
    fn(d)
    (path / name).write_text(json.dumps(d))


@pytest.mark.transformers4
@pytest.mark.parametrize("target", ["mindie", "vllm-ascend", "vllm"])
def test_good_artifacts_pass(good, capsys, target):
    assert main(["inspect", str(good[target]), "--target", target]) == 0
    assert main(["inspect", str(good[target])]) == 0  # the recorded target
    assert f"target {target}" in capsys.readouterr().out
    for other in {"mindie", "vllm-ascend", "vllm"} - {target}:
        assert not inspect_artifact(good[target], target=other)["valid"]


def _set_scale(value):
    def fn(target, t):
        name = SCALE[target]
        s = t[name].clone()
        if callable(value):
            s = value(s)
        else:
            s.fill_(value)
        t[name] = s

    return fn


def _first(v):
    def fn(s):
        s.view(-1)[0] = v
        return s

    return fn


SCALE_BREAKS = [
    ("negative", _set_scale(_first(-1.0)), "values <= 0"),
    ("zero", _set_scale(0.0), "values <= 0"),
    ("nan", _set_scale(_first(float("nan"))), "non-finite values"),
    ("inf", _set_scale(_first(float("inf"))), "non-finite values"),
    ("subnormal", _set_scale(1e-40), "subnormal in"),
    ("placeholder", _set_scale(1.0), "all exactly 1.0"),
]


@pytest.mark.parametrize("target", ["mindie", "vllm-ascend", "vllm"])
@pytest.mark.parametrize(
    "case,fn,message", SCALE_BREAKS, ids=[b[0] for b in SCALE_BREAKS]
)
def test_degenerate_scales(copy, capsys, target, case, fn, message):
    path = copy(target)
    edit_tensors(path, lambda t: fn(target, t))
    assert main(["inspect", str(path), "--target", target]) == 1
    out = capsys.readouterr().out
    assert f"{SCALE[target]}: {message}" in out, out
    assert main(["inspect", str(path), "--target", target, "--json"]) == 1

    def strict(token):
        raise AssertionError(f"non-strict JSON constant {token}")

    data = json.loads(capsys.readouterr().out, parse_constant=strict)
    assert not data["valid"] and data["target"] == target


def _drop_layer(target):
    def fn(path):
        prefix = "model.layers.1.self_attn."
        keep = {
            "mindie": (".fa_",),
            "vllm-ascend": (".kv_cache_",),
            "vllm": ("_scale",),
        }[target]

        def gone(n):
            return (
                n.startswith(prefix)
                and any(k in n for k in keep)
                and (target != "vllm" or n.endswith((".k_scale", ".v_scale")))
            )

        edit_tensors(path, lambda t: [t.pop(n) for n in [n for n in t if gone(n)]])
        if (path / DESCRIPTION_FILE).exists():
            edit_json(
                path,
                DESCRIPTION_FILE,
                lambda d: [d.pop(n) for n in [n for n in d if gone(n)]],
            )

    return fn


def _outside(path):
    t = load_file(str(path / WEIGHTS_NAME))
    (path / "quant_model_weights.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(t, "../elsewhere.safetensors")})
    )


BREAKS = [
    (
        "mindie",
        lambda p: edit_json(
            p, "config.json", lambda c: c.update(quantization_config={"a": 1})
        ),
        "config.json: quantization_config present",
    ),
    (
        "vllm-ascend",
        lambda p: edit_json(
            p, "config.json", lambda c: c.update(quantization_config={"a": 1})
        ),
        "config.json: quantization_config present",
    ),
    ("mindie", _drop_layer("mindie"), "model.layers.1.self_attn: a layer with no"),
    (
        "vllm-ascend",
        _drop_layer("vllm-ascend"),
        "model.layers.1.self_attn: a layer with no",
    ),
    ("vllm", _drop_layer("vllm"), "model.layers.1.self_attn: a layer with no"),
    ("mindie", _outside, "points outside the artifact"),
    ("vllm", _outside, "points outside the artifact"),
    (
        "vllm-ascend",
        lambda p: edit_json(p, DESCRIPTION_FILE, lambda d: d.pop("lm_head.weight")),
        "lm_head.weight: tied lm_head not described",
    ),
    (
        "mindie",
        lambda p: edit_json(p, "config.json", lambda c: c.pop("torch_dtype")),
        "config.json: torch_dtype missing",
    ),
    (
        "vllm",
        lambda p: edit_json(p, "config.json", lambda c: c.pop("torch_dtype")),
        "config.json: torch_dtype missing",
    ),
    (
        "mindie",
        lambda p: edit_json(
            p, "config.json", lambda c: c.update(torch_dtype="float32")
        ),
        "MindIE loads only float16 or bfloat16",
    ),
    (
        "mindie",
        lambda p: edit_json(
            p, DESCRIPTION_FILE, lambda d: d.update(model_quant_type="FLOAT")
        ),
        "model_quant_type: 'FLOAT'; MindIE sets quantize",
    ),
    (
        "vllm-ascend",
        lambda p: edit_json(
            p, DESCRIPTION_FILE, lambda d: d.update(fa_quant_type="FAQuant")
        ),
        "registers only FAKQuant",
    ),
    (
        "vllm-ascend",
        lambda p: edit_tensors(
            p,
            lambda t: t.update(
                {"model.layers.0.self_attn.k_proj.kv_cache_scale": torch.ones(2) * 0.01}
            ),
        ),
        "C8 is per channel [Hkv*D] = [16]",
    ),
    (
        "vllm-ascend",
        lambda p: edit_tensors(
            p,
            lambda t: t.update(
                {
                    "model.layers.0.self_attn.v_proj.kv_cache_offset": torch.ones(
                        16, dtype=torch.int32
                    )
                }
            ),
        ),
        "kv_cache_offset: nonzero offsets",
    ),
    (
        "vllm",
        lambda p: edit_tensors(
            p,
            lambda t: t.update(
                {"model.layers.0.self_attn.fa_q.scale": torch.full((4, 1), 0.01)}
            ),
        ),
        "fa_q.scale: vLLM has no parameter for this Ascend-only tensor",
    ),
    (
        "vllm",
        lambda p: edit_tensors(
            p,
            lambda t: t.update(
                {"model.layers.0.self_attn.k_scale": torch.full((2,), 0.01)}
            ),
        ),
        "k_scale: shape [2]; vLLM creates [1] for strategy 'tensor'",
    ),
    (
        "vllm",
        lambda p: edit_json(
            p,
            "config.json",
            lambda c: c["quantization_config"]["kv_cache_scheme"].update(
                symmetric=False
            ),
        ),
        "kv_cache_scheme needs symmetric true",
    ),
]


@pytest.mark.parametrize("target,fn,message", BREAKS)
def test_broken_copies(copy, capsys, target, fn, message):
    path = copy(target)
    fn(path)
    assert main(["inspect", str(path), "--target", target]) == 1
    out = capsys.readouterr().out
    assert message in out, out


def test_unknown_target_is_bad_input(good, capsys):
    assert main(["inspect", str(good["vllm"]), "--target", "trt"]) == 2
    err = capsys.readouterr().err
    assert "--target 'trt' is not a known target" in err
    assert len(err.strip().splitlines()) == 1
