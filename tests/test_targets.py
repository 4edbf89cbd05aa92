"""``calibrate --target mindie|vllm-ascend|vllm``: each artifact passes its
consumer's rules (``inspect --target``), the KV-cache scales fit the post-RoPE K/V
the calibration saw, and bad requests end in one line with exit 2."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from builders import (  # noqa: E402
    byte_tokenizer,
    quantize_linears,
    save_tiny,
    tiny_deepseek,
    tiny_llama,
)

from ascend_fa import artifact  # noqa: E402
from ascend_fa.artifact import (  # noqa: E402
    DESCRIPTION_FILE,
    WEIGHTS_NAME,
    checkpoint_tensors,
    export_artifact,
    inspect_artifact,
)
from ascend_fa.calibration import default_recipe  # noqa: E402
from ascend_fa.calibration.data import load_calib_texts, split_calibration  # noqa: E402
from ascend_fa.calibration.pipeline import calibrate_model  # noqa: E402
from ascend_fa.cli import main  # noqa: E402

BF16 = torch.bfloat16
#: Llama C8 loads from vllm-ascend 0.25.1rc1 on (ascend_fa.artifact.releases);
#: the default release (0.23.0.post1) refuses it.
LLAMA_RELEASE = {"vllm-ascend": ("--consumer-version", "0.25.1rc1")}
MINMAX = 'spec:\n  process:\n    - type: "fa3_quant"\n      method: minmax\n'
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b  # small helper",
    "Ascend NPUs run attention with int8 caches in fractal layouts.",
    "A lighthouse keeper climbed the stairs every evening at dusk.",
    "Numbers: 3.14159, 2.71828, 1.41421 and 0.57721 appear often.",
    "SELECT name, value FROM table WHERE id = 42 ORDER BY name;",
    "Rain fell softly on the tin roof while the kettle began to sing.",
    "for i in range(10): print(i * i)",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save_tiny(
            root / "llama", "llama", dtype=BF16, tie_word_embeddings=False
        ),
        "qwen3": save_tiny(root / "qwen3", "qwen3", dtype=BF16),
        "deepseek_v3": save_tiny(root / "ds", "deepseek_v3", dtype=BF16),
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    recipe = path.parent / "minmax.yaml"
    recipe.write_text(MINMAX)
    return path, recipe


def run_calibrate(model_dir, out, data, *extra):
    calib, recipe = data
    return main(
        [
            "calibrate",
            "--model",
            str(model_dir),
            "--calib-data",
            str(calib),
            "--recipe",
            str(recipe),
            "--num-samples",
            "6",
            "--max-length",
            "32",
            "--batch-size",
            "3",
            "--heldout",
            "2",
            "--output",
            str(out),
            "-q",
            *extra,
        ]
    )


def reference_kv(model_dir, data, rope=True):
    """Independent post-RoPE K and V per layer: each calibration text run alone
    (no padding), K from ``k_proj`` (+ ``k_norm``) and transformers'
    ``apply_rotary_pos_emb`` with the layer's own ``position_embeddings``.
    Returns ``{attn: (K [N, Hkv, D], V [N, Hkv, D])}`` over all real tokens."""
    calib, _ = data
    texts, _ = split_calibration(load_calib_texts(calib), 6, 2, 0)
    # the calibration loads checkpoints in fp32 (ascend_fa.models.load_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    mod = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    got: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        name = f"model.layers.{i}.self_attn"

        def hook(m, args, kwargs, name=name):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            b, s, _ = h.shape
            k = m.k_proj(h).view(b, s, -1, m.head_dim)
            if hasattr(m, "k_norm"):
                k = m.k_norm(k)
            k = k.transpose(1, 2)
            v = m.v_proj(h).view(b, s, -1, m.head_dim).transpose(1, 2)
            if rope:
                _, k = mod.apply_rotary_pos_emb(k, k, cos, sin)
            got.setdefault(name, []).append(
                (k[0].transpose(0, 1), v[0].transpose(0, 1))
            )

        handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        for t in texts:
            ids = tok(t, truncation=True, max_length=32, return_tensors="pt")
            model(**ids, use_cache=False)
    for h in handles:
        h.remove()
    return {
        n: (torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]))
        for n, kv in got.items()
    }


def _pair_norms(x: torch.Tensor) -> torch.Tensor:
    """``[N, Hkv, D]`` -> each channel's RoPE pair norm ``sqrt(x_d² + x_{d±D/2}²)``
    (rotate_half layout), in float64."""
    half = x.shape[-1] // 2
    a, b = x[..., :half].double(), x[..., half:].double()
    n = (a * a + b * b).sqrt()
    return torch.cat([n, n], dim=-1)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_c8_vllm_ascend(models, data, tmp_path, name):
    out = tmp_path / "c8"
    # Qwen3 C8 loads in the default release (0.23.0.post1), Llama from 0.25.1rc1
    args = (
        "--target",
        "vllm-ascend",
        *(() if name == "qwen3" else LLAMA_RELEASE["vllm-ascend"]),
    )
    assert run_calibrate(models[name], out, data, *args) == 0
    assert main(["inspect", str(out), *args]) == 0
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    assert desc["kv_cache_type"] == "C8" and desc["kv_quant_type"] == "C8"
    assert "fa_quant_type" not in desc and desc["model_quant_type"] == "FLOAT"
    assert desc["metadata"]["ascend_fa_target"] == "vllm-ascend"
    t = load_file(str(out / WEIGHTS_NAME))
    assert not [n for n in t if ".fa_" in n]
    ref = reference_kv(models[name], data)
    pre = reference_kv(models[name], data, rope=False)
    for attn, (k, v) in ref.items():
        hkv, d = k.shape[1], k.shape[2]
        for side, x, x_pre in (("k", k, pre[attn][0]), ("v", v, None)):
            scale = t[f"{attn}.{side}_proj.kv_cache_scale"]
            offset = t[f"{attn}.{side}_proj.kv_cache_offset"]
            assert scale.dtype == torch.float32 and scale.shape == (hkv * d,)
            assert offset.shape == (hkv * d,) and not offset.any()
            assert desc[f"{attn}.{side}_proj.kv_cache_scale"] == "C8"
            # per channel c = h * D + d: max |x| over every calibration token;
            # K's channels the max of their RoPE pair's norm (holds at every
            # position)
            seen = _pair_norms(x) if side == "k" else x.abs()
            want = (seen.amax(dim=0).reshape(-1) / 127).clamp(min=2**-23).float()
            torch.testing.assert_close(scale, want, rtol=2e-5, atol=0)
            # not transposed [D, Hkv]
            wrong = x.abs().amax(dim=0).t().reshape(-1) / 127
            assert not torch.allclose(scale, wrong, rtol=1e-3)
            if x_pre is not None:  # and not the pre-RoPE K
                pre_scale = x_pre.abs().amax(dim=0).reshape(-1) / 127
                assert not torch.allclose(scale, pre_scale, rtol=1e-3)
    if name == "qwen3":  # tied lm_head: written and described, as msModelSlim does
        assert desc["lm_head.weight"] == "FLOAT"
        assert torch.equal(t["lm_head.weight"], t["model.embed_tokens.weight"])
    rep = json.loads((out / "calibration_report.json").read_text())
    assert rep["target"] == "vllm-ascend" and rep["deployed"] == "C8"
    for p in out.iterdir():
        assert p.stat().st_mode & 0o777 == 0o666 & ~_umask(), p


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_vllm_compressed_tensors(models, data, tmp_path, strategy):
    out = tmp_path / "vllm"
    extra = ("--target", "vllm", "--kv-strategy", strategy, "--dtype", "fp16")
    assert run_calibrate(models["llama"], out, data, *extra) == 0
    assert main(["inspect", str(out), "--target", "vllm"]) == 0
    assert inspect_artifact(out)["target"] == "vllm"  # recorded by the config
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float16"
    assert cfg["quantization_config"] == {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": {
            "num_bits": 8,
            "type": "float",
            "strategy": strategy,
            "symmetric": True,
            "dynamic": False,
        },
    }
    assert not (out / DESCRIPTION_FILE).exists()
    t = load_file(str(out / WEIGHTS_NAME))
    assert not [n for n in t if ".fa_" in n or "kv_cache" in n]
    assert "lm_head.weight" in t  # untied llama
    ref = reference_kv(models["llama"], data)
    for attn, (k, v) in ref.items():
        for side, x in (("k", k), ("v", v)):
            s = t[f"{attn}.{side}_scale"]
            seen = _pair_norms(x) if side == "k" else x.abs()
            amax = seen.amax(dim=(0, 2)).float()  # per KV head
            if strategy == "tensor":
                amax = amax.max().reshape(1)
            assert s.dtype == torch.float32 and s.shape == amax.shape
            torch.testing.assert_close(s, amax / 448, rtol=2e-5, atol=0)


def _calibrated(model, texts, recipe=None):
    tok = byte_tokenizer()
    result = calibrate_model(
        model,
        tok,
        texts,
        recipe=recipe or default_recipe(),
        max_length=32,
        batch_size=3,
        progress=False,
    )
    scales = result.export_scales(model)
    result.remove(model)
    return scales, result.adapter.fa_quant_type


def _write(model, out, target, scales, fa_quant_type, **kw):
    ckpt = checkpoint_tensors(
        model, torch.bfloat16, tied_copies=target in artifact.ASCEND_TARGETS
    )
    cfg = model.config.to_dict()
    return export_artifact(
        out,
        state_dict=ckpt.tensors,
        tensor_types=ckpt.types,
        scales=scales,
        fa_quant_type=fa_quant_type,
        target=target,
        dtype=torch.bfloat16,
        config=cfg,
        **kw,
    )


def mindie_artifact(tmp_path, quant_type="W8A8"):
    model = tiny_llama(tie_word_embeddings=False)
    names = quantize_linears(model, quant_type)
    scales, fa_type = _calibrated(model, TEXTS)
    out = _write(model, tmp_path / "mindie", "mindie", scales, fa_type)
    return out, names


def test_mindie_with_quantized_linears(tmp_path):
    out, names = mindie_artifact(tmp_path)
    assert main(["inspect", str(out), "--target", "mindie"]) == 0
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["model_quant_type"] == "W8A8" and desc["fa_quant_type"] == "FAQuant"
    linears = [n for n in desc if n.endswith("_proj.weight") or n == "lm_head.weight"]
    quantized = [n for n in linears if desc[n] == "W8A8"]
    assert len(quantized) >= 0.8 * len(linears) and len(quantized) == len(names)
    with safe_open(str(out / WEIGHTS_NAME), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert w.dtype == torch.int8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.deq_scale").dtype == (
            torch.float32
        )
        assert f.get_tensor("model.layers.0.self_attn.fa_q.scale").shape == (4, 1)
    # the same artifact does not load where FAQuant is not registered
    r = inspect_artifact(out, target="vllm-ascend")
    assert any("registers only FAKQuant" in f for f in r["findings"])


def test_deepseek_fakquant_w8a8_dynamic_vllm_ascend(tmp_path):
    model = tiny_deepseek()
    quantize_linears(
        model, "W8A8_DYNAMIC", skip=("lm_head", "kv_b_proj", "gate", "o_proj")
    )
    scales, fa_type = _calibrated(model, TEXTS)
    assert fa_type == "FAKQuant"
    out = _write(model, tmp_path / "ds", "vllm-ascend", scales, fa_type)
    r = inspect_artifact(out, target="vllm-ascend")
    assert r["valid"], r["findings"]
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"
    assert desc["fa_quant_type"] == "FAKQuant"
    # MoE experts under the checkpoint's names, never the fused in-memory ones
    assert desc["model.layers.1.mlp.experts.3.down_proj.weight"] == "FLOAT"
    assert not [n for n in desc if n.endswith("experts.gate_up_proj")]
    assert desc["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale"] == (
        "W8A8_DYNAMIC"
    )
    # without quantized MLA linears vllm-ascend's FAKQuant path cannot load it
    with pytest.raises(ValueError, match="reads the quantized MLA linears"):
        _write(tiny_deepseek(), tmp_path / "ds2", "vllm-ascend", scales, fa_type)
    assert not (tmp_path / "ds2").exists()


def test_checkpoint_names_match_save_pretrained(tmp_path):
    model = tiny_deepseek()
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    ckpt = checkpoint_tensors(model)
    assert set(ckpt.tensors) == saved
    assert ckpt.model_quant_type == "FLOAT"


@pytest.mark.parametrize("layout", ["single", "shards", "legacy"])
@pytest.mark.parametrize("target", ["mindie", "vllm-ascend"])
def test_merge_into_export(models, data, tmp_path, layout, target):
    from builders import msmodelslim_export

    export = tmp_path / "w8a8"
    desc = msmodelslim_export(
        export, models["llama"], layout=layout, keep_quant_config=True
    )
    before = {
        p.name: p.read_bytes() for p in export.iterdir() if p.suffix == ".safetensors"
    }
    out = tmp_path / "merged"
    release = LLAMA_RELEASE.get(target, ())
    rc = run_calibrate(
        models["llama"],
        out,
        data,
        "--target",
        target,
        *release,
        "--merge-into",
        str(export),
    )
    assert rc == 0
    assert main(["inspect", str(out), "--target", target, *release]) == 0
    for name, blob in before.items():  # the export's linears kept byte for byte
        assert (out / name).read_bytes() == blob
    new = json.loads((out / DESCRIPTION_FILE).read_text())
    for k, v in desc.items():
        if k != "metadata":
            assert new[k] == v
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    if target == "mindie":
        assert new["fa_quant_type"] == "FAQuant" and "kv_cache_type" not in new
    else:
        assert new["kv_cache_type"] == "C8" and "fa_quant_type" not in new


def test_merge_into_refused_before_the_model_loads(models, data, tmp_path, capsys):
    from builders import msmodelslim_export

    import ascend_fa.models

    calls = []
    real = ascend_fa.models.load_model

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    mp = pytest.MonkeyPatch()
    mp.setattr(ascend_fa.models, "load_model", counting)
    try:
        empty = tmp_path / "empty"
        empty.mkdir()
        rc = run_calibrate(
            models["llama"], tmp_path / "o1", data, "--merge-into", str(empty)
        )
        assert rc == 2 and "not an msModelSlim export" in capsys.readouterr().err
        other = tmp_path / "ds_export"
        msmodelslim_export(other, models["deepseek_v3"])
        rc = run_calibrate(
            models["qwen3"], tmp_path / "o2", data, "--merge-into", str(other)
        )
        err = capsys.readouterr().err
        assert rc == 2 and "belongs to another model" in err, err
        assert len(err.strip().splitlines()) == 1
    finally:
        mp.undo()
    assert calls == []
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (("--target", "tensorrt"), "--target 'tensorrt' is not a known target"),
        (("--target", "vllm", "--dtype", "fp64"), "--dtype 'fp64' is not supported"),
        (("--target", "vllm", "--clip-search"), "--clip-search tunes FAQuant"),
    ],
)
def test_bad_requests(models, data, tmp_path, capsys, args, message):
    rc = run_calibrate(models["llama"], tmp_path / "o", data, *args)
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_mindie_with_float_linears_is_a_research_artifact(
    models, data, tmp_path, capsys, caplog
):
    """--target mindie --linear none is allowed (attention-only research
    artifact) with one warning line; inspect --target mindie calls it not
    deployable (exit 1) and names model_quant_type."""
    import logging

    out = tmp_path / "fa_only"
    with caplog.at_level(logging.WARNING):
        rc = run_calibrate(
            models["llama"], out, data, "--target", "mindie", "--linear", "none"
        )
    assert rc == 0, capsys.readouterr().err
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "MindIE loads FA quantization only beside quantized linears" in warned[0]
    assert "\n" not in warned[0]
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["model_quant_type"] == "FLOAT" and desc["fa_quant_type"] == "FAQuant"
    capsys.readouterr()
    assert main(["inspect", str(out), "--target", "mindie"]) == 1
    shown = capsys.readouterr()
    assert "model_quant_type: 'FLOAT'" in shown.out + shown.err
    # quantized linears, or an export's (--merge-into), need no warning
    assert artifact.target_warning("mindie", model_quant_type="W8A8") is None
    assert (
        artifact.target_warning("mindie", model_quant_type="FLOAT", merge=True) is None
    )
    assert artifact.target_warning("vllm", model_quant_type="FLOAT") is None


def test_target_cannot_express_model(models, data, tmp_path, capsys):
    for target, message in (
        ("vllm", "--target vllm cannot express model type 'deepseek_v3'"),
        ("vllm-ascend", "cannot express model type 'deepseek_v3' with float linears"),
    ):
        rc = run_calibrate(
            models["deepseek_v3"],
            tmp_path / "o",
            data,
            "--target",
            target,
            "--linear",
            "none",
        )
        err = capsys.readouterr().err
        assert rc == 2 and message in err, err
    assert not (tmp_path / "o").exists()


def test_check_target_rules():
    from ascend_fa.errors import UnsupportedError

    artifact.check_target("vllm-ascend", mla=False, model_quant_type="FLOAT")
    artifact.check_target("mindie", mla=True, model_quant_type="W8A8_DYNAMIC")
    artifact.check_target("mindie", model_quant_type="FLOAT", merge=True)
    with pytest.raises(UnsupportedError, match="dense float weights"):
        artifact.check_target("vllm", mla=False, model_quant_type="W8A8")
    with pytest.raises(UnsupportedError, match="--merge-into adds Ascend tensors"):
        artifact.check_target("vllm", merge=True)
    # allowed: an attention-only research artifact, with target_warning's line
    artifact.check_target("mindie", mla=False, model_quant_type="FLOAT")
    assert "not deployable" in artifact.target_warning(
        "mindie", model_quant_type="FLOAT"
    )
    with pytest.raises(ValueError, match="not a known target"):
        artifact.resolve_target("trt")
    assert artifact.resolve_dtype("fp16") is torch.float16
    assert artifact.resolve_dtype("bfloat16") is torch.bfloat16
    # float32 only where research artifacts are meant (calibrate, benchmarks)
    assert artifact.resolve_dtype("fp32", research=True) is torch.float32
    assert artifact.resolve_dtype("float32", research=True) is torch.float32
    with pytest.raises(ValueError, match="fp32 is a research dtype"):
        artifact.resolve_dtype("fp32")
    assert artifact.is_research_dtype(torch.float32)
    assert not artifact.is_research_dtype(torch.bfloat16)


@pytest.mark.parametrize(
    "target,extra",
    # unrotated: the point is every source bit kept (a rotation changes lm_head)
    [
        ("vllm-ascend", ()),
        ("vllm", ()),
        ("mindie", ("--linear", "w8a8", "--rotate", "off")),
    ],
)
def test_fp32_research_artifact(models, data, tmp_path, capsys, target, extra):
    """``--dtype fp32`` keeps the weights exactly (float32, as calibrated) and the
    artifact says it is research: the description's metadata, the report, one
    summary line, and ``inspect --target`` refuses it (exit 1) with the reason."""
    out = tmp_path / "r"
    args = (
        "--target",
        target,
        *LLAMA_RELEASE.get(target, ()),
        "--dtype",
        "fp32",
        *extra,
    )
    assert run_calibrate(models["llama"], out, data, *args) == 0
    printed = capsys.readouterr().out
    assert "float32 weights: a research artifact" in printed, printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32"
    rep = json.loads((out / "calibration_report.json").read_text())
    assert rep["research_artifact"] is True and rep["dtype"] == "float32"
    if target != "vllm":
        desc = json.loads((out / DESCRIPTION_FILE).read_text())
        assert desc["metadata"][artifact.RESEARCH_METADATA_KEY] == "float32"
    t = load_file(str(out / WEIGHTS_NAME))
    src = load_file(str(models["llama"] / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight" if not extra else "lm_head.weight"
    # bf16 source -> fp32 model -> fp32 artifact: every bit kept
    assert t[name].dtype == torch.float32
    assert torch.equal(t[name], src[name].float())
    rc = main(["inspect", str(out), "--target", target])
    shown = capsys.readouterr()
    assert rc == 1, shown
    assert "a research artifact: calibrate --dtype fp32" in shown.out + shown.err


def test_merge_fakquant_into_deepseek_export_for_vllm_ascend(models, data, tmp_path):
    from builders import msmodelslim_export

    export = tmp_path / "w8a8"
    msmodelslim_export(export, models["deepseek_v3"], quant_type="W8A8_DYNAMIC")
    out = tmp_path / "merged"
    rc = run_calibrate(
        models["deepseek_v3"],
        out,
        data,
        "--target",
        "vllm-ascend",
        "--merge-into",
        str(export),
    )
    assert rc == 0
    r = inspect_artifact(out, target="vllm-ascend")
    assert r["valid"], r["findings"]
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["fa_quant_type"] == "FAKQuant"
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"
