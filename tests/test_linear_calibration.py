"""Layer-sequential W8A8 calibration on tiny real models, export and load back."""

from __future__ import annotations

import json

import pytest
import torch
from builders import (
    byte_tokenizer,
    save_tiny,
    tiny_causal_lm,
    tiny_deepseek,
    tiny_llama,
)
from safetensors.torch import load_file, save_file
from torch import nn

from ascend_fa.calibration.pipeline import calibration_batches
from ascend_fa.cli import main
from ascend_fa.errors import UnsupportedError
from ascend_fa.linear import (
    LinearConfig,
    W8A8Linear,
    calibrate_linears,
    export_state,
    linear_plan,
    load_quantized_model,
    quantized_modules,
    read_artifact_tensors,
    swap_group,
)

TEXTS = [
    f"Sample {i}: the quick brown fox jumps over {i * 7} lazy dogs; print(x[{i}])"
    for i in range(8)
]


def _batches(tok, texts=TEXTS, length=48):
    return list(calibration_batches(tok, texts, max_length=length, batch_size=3))


def _logits(model, tok):
    enc = tok(TEXTS[:3], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**enc).logits


def _run(model, tok, **cfg):
    config = LinearConfig(**{"dtype": torch.bfloat16, "fallback": 0, **cfg})
    scan = _batches(tok, TEXTS[:2], 32) if config.fallback != 0 else []
    return calibrate_linears(model, _batches(tok), config, scan_batches=scan)


def test_every_planned_linear_quantized_and_groups_share_input_scale():
    tok = byte_tokenizer()
    model = tiny_llama(num_hidden_layers=2)
    result = _run(model, tok)
    mods = quantized_modules(model)
    assert len(mods) == 14 and result.counts() == {"W8A8": 14}
    for plan in linear_plan(model):
        for group in plan.groups:
            first = mods[group.linears[0]]
            for name in group.linears[1:]:
                # vllm-ascend fuses them (one per-tensor parameter) and MindIE
                # raises when they differ: one scale and offset per group.
                assert torch.equal(mods[name].input_scale, first.input_scale)
                assert torch.equal(mods[name].input_offset, first.input_offset)
    assert isinstance(model.lm_head, nn.Linear)  # the head stays float


def test_quantized_model_is_close_and_smoothing_keeps_float_function():
    tok = byte_tokenizer()
    ref_model = tiny_llama()
    ref = _logits(ref_model, tok)
    model = tiny_llama()
    result = _run(model, tok)
    assert any(r.decision and r.decision.alpha is not None for r in result.records)
    quant = _logits(model, tok)
    assert float((quant - ref).abs().max()) < 0.1 * float(ref.abs().max())
    # Every group back to its (smoothed) float modules: the float function is kept.
    for record in result.records:
        swap_group(model, record.float_modules)
    torch.testing.assert_close(_logits(model, tok), ref, rtol=1e-4, atol=1e-4)


def test_dynamic_and_round_to_nearest_configs():
    tok = byte_tokenizer()
    model = tiny_llama()
    result = _run(model, tok, quant_type="W8A8_DYNAMIC")
    assert result.counts() == {"W8A8_DYNAMIC": 14}
    rtn = LinearConfig.round_to_nearest("W8A8", torch.bfloat16)
    assert rtn.alphas == (None,) and rtn.clips == (1.0,) and rtn.fallback == 0
    model = tiny_llama()
    result = calibrate_linears(model, _batches(tok), rtn)
    assert all(
        r.decision.alpha is None and r.decision.clip == 1.0 for r in result.records
    )


def test_headroom_widens_only_the_down_proj_ranges():
    """The default config gives each ``down_proj`` (an MLP's gated product) a
    headroom >= 1 on its searched static range and the other groups none; the
    placed module quantizes with the widened range, and the report says so."""
    from ascend_fa.linear.modules import activation_qparams

    tok = byte_tokenizer()
    model = tiny_llama(num_hidden_layers=2)
    result = _run(model, tok)
    mods = quantized_modules(model)
    kinds = set()
    for r in result.records:
        kinds.add(r.group.kind)
        h = r.decision.headroom
        assert (h >= 1.0) if r.group.kind == "down" else (h == 1.0), r.group.name
        assert r.to_dict()["headroom"] == h
        scale, offset = activation_qparams(r.decision.lo, r.decision.hi, torch.bfloat16)
        for name in r.group.linears:
            assert float(mods[name].input_scale) == pytest.approx(scale, rel=1e-6)
            assert int(mods[name].input_offset) == offset
    assert {"down", "qkv", "o", "gate_up"} <= kinds
    plain = _run(tiny_llama(num_hidden_layers=2), tok, headroom_doublings=0.0)
    assert all(r.decision.headroom == 1.0 for r in plain.records)
    # layer 0 sees the same inputs in both runs (later layers see layer 0's
    # quantized outputs, which the headroom changes)
    checked = 0
    for a, b in zip(result.records, plain.records, strict=True):
        if a.group.kind == "down" and ".layers.0." in a.group.name:
            checked += 1
            assert a.decision.headroom > 1.0
            assert (a.decision.alpha, a.decision.clip) == (
                b.decision.alpha,
                b.decision.clip,
            )
            assert a.decision.hi == pytest.approx(
                a.decision.headroom * b.decision.hi, rel=1e-6
            )
    assert checked == 1
    rtn = LinearConfig.round_to_nearest("W8A8", torch.bfloat16)
    assert rtn.headroom_doublings == 0.0


@pytest.mark.parametrize("bad", [-1.0, True, "2", float("nan"), 11.0])
def test_linear_config_refuses_bad_headroom_doublings(bad):
    from ascend_fa.errors import InputError

    with pytest.raises(InputError, match="headroom_doublings"):
        LinearConfig("W8A8", torch.bfloat16, headroom_doublings=bad)


def test_kl_fallback_keeps_whole_groups_float():
    tok = byte_tokenizer()
    model = tiny_llama()
    result = _run(model, tok, fallback=3, scan_candidates=0, criterion="kl")
    floats = [r for r in result.records if r.quant_type == "FLOAT"]
    assert 0 < result.num_float <= 3
    scanned = [r for r in result.records if r.kl_gain is not None]
    assert len(scanned) == len(result.records)
    for record in floats:
        assert record.reason.startswith("fallback: KL gain")
        for name in record.group.linears:
            assert isinstance(model.get_submodule(name), nn.Linear)
    # the chosen groups are those with the largest gain that fit the count
    best = max(scanned, key=lambda r: r.kl_gain)
    if len(best.group.linears) <= 3:
        assert best in floats


def test_layer_fallback_is_layer_local_and_capped():
    """The default criterion: per layer, groups with the largest gain go float
    while the layer's output error is over the budget, within the model-wide cap;
    each chosen group's gain was measured on the scan data."""
    tok = byte_tokenizer()
    model = tiny_llama()
    result = _run(model, tok, fallback=3, layer_budget=0.0)
    assert result.config.criterion == "layer"
    floats = [r for r in result.records if r.quant_type == "FLOAT"]
    assert 0 < result.num_float <= 3
    assert all(r.layer_gain is not None for r in result.records)
    assert set(result.layer_error) == {"model.layers.0", "model.layers.1"}
    for record in floats:
        assert record.reason.startswith("fallback: layer output error")
        assert record.layer_gain > 0
        for name in record.group.linears:
            assert isinstance(model.get_submodule(name), nn.Linear)
    # the first layer's best group (largest gain per linear: the cap counts
    # linears) is the first one taken
    first = [r for r in result.records if r.group.name.startswith("model.layers.0.")]
    best = max(first, key=lambda r: r.layer_gain / len(r.group.linears))
    assert best in floats
    # a generous budget keeps everything quantized
    relaxed = _run(tiny_llama(), tok, fallback=3, layer_budget=1.0)
    assert relaxed.num_float == 0


@pytest.mark.parametrize("quant_type", ["W8A8", "W8A8_DYNAMIC"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_deepseek], ids=["llama", "mla"])
def test_decisions_do_not_depend_on_the_cpu_int_product(build, quant_type, monkeypatch):
    """The search, the layer fallback and the quantized forwards give the same
    decisions (alpha, clip, range, fallback set, gains) and bit-equal artifact
    tensors whichever exact CPU product ``int_gemm`` takes (torch's int8 GEMM, the
    one the search was built on, or the fp32 K chunks)."""
    from ascend_fa.atb_ops import linear as linear_ops

    tok = byte_tokenizer()
    runs = []
    for int_mm in (True, False):
        monkeypatch.setattr(linear_ops, "_CPU_INT_MM", int_mm)
        model = build()
        config = {"quant_type": quant_type, "fallback": 3, "layer_budget": 0.0}
        result = _run(model, tok, **config)
        state = export_state(model, dict(model.state_dict()))
        report = result.to_report()
        report.pop("seconds")
        runs.append((report, state))
    (report_a, state_a), (report_b, state_b) = runs
    assert report_a == report_b
    assert any(g["quant_type"] == "FLOAT" for g in report_a["groups"])
    assert state_a.keys() == state_b.keys()
    for key, tensor in state_a.items():
        assert torch.equal(tensor, state_b[key]), key


@pytest.mark.parametrize("quant_type", ["W8A8", "W8A8_DYNAMIC"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_deepseek], ids=["llama", "mla"])
def test_stopping_candidates_early_changes_no_decision(build, quant_type, monkeypatch):
    """The held-out search scores candidates chunk by chunk and stops those that
    cannot win; against every candidate scored on all rows in one piece (the
    search before the stop: one chunk, no stop) the decisions, gains and artifact
    tensors are bit-equal, with fewer rows scored."""
    from ascend_fa.linear import search

    tok = byte_tokenizer()
    runs = []
    real = search._HeldOutScorer.chunk_errors
    for full in (True, False):
        rows = [0]

        def counted(self, alpha, clip, i, k, rows=rows):
            out = real(self, alpha, clip, i, k)
            rows[0] += out.numel()
            return out

        monkeypatch.setattr(search._HeldOutScorer, "chunk_errors", counted)
        monkeypatch.setattr(search, "_CHUNKS", 1 if full else 8)
        monkeypatch.setattr(search, "_PRUNE_MARGIN", float("inf") if full else 1e-4)
        model = build()
        config = {"quant_type": quant_type, "fallback": 3, "layer_budget": 0.0}
        result = _run(model, tok, **config)
        report = result.to_report()
        report.pop("seconds")
        runs.append((report, export_state(model, dict(model.state_dict())), rows[0]))
    (report_a, state_a, rows_a), (report_b, state_b, rows_b) = runs
    assert report_a == report_b
    assert state_a.keys() == state_b.keys()
    for key, tensor in state_a.items():
        assert torch.equal(tensor, state_b[key]), key
    assert rows_b < rows_a


def test_layer_fallback_spends_the_cap_pro_rata_over_depth():
    """A layer cannot see the layers after it, so after the i-th of L layers at
    most ceil(cap * i / L) linears are float; a share a layer does not use passes
    on. Naive reference: the running share, layer by layer."""
    from ascend_fa.linear.fallback import LayerFallback

    layers = [f"model.layers.{i}" for i in range(30)]
    chooser = LayerFallback(LinearConfig(fallback=21), 210, layers=layers)
    for i, prefix in enumerate(layers, start=1):
        share = 0
        while share * 30 < 21 * i:  # the smallest integer >= 21 * i / 30
            share += 1
        assert chooser.allowance(f"{prefix}.mlp.down") == share
    assert chooser.allowance("model.layers.29.self_attn.qkv") == 21
    # a group outside the listed layers (or no layers given): the whole cap
    assert chooser.allowance("model.extra.down") == 21
    assert (
        LayerFallback(LinearConfig(fallback=21), 210).allowance(
            "model.layers.0.mlp.down"
        )
        == 21
    )
    # on a model: with no budget every layer wants more, and the first of four
    # layers gets its share of a cap of 4 linears only (one linear)
    tok = byte_tokenizer()
    result = _run(tiny_llama(num_hidden_layers=4), tok, fallback=4, layer_budget=0.0)
    per_layer = [
        sum(
            len(r.group.linears)
            for r in result.records
            if r.quant_type == "FLOAT" and r.group.name.startswith(f"model.layers.{i}.")
        )
        for i in range(4)
    ]
    assert per_layer[0] <= 1 and sum(per_layer[:2]) <= 2 and sum(per_layer) <= 4
    assert sum(per_layer) > 0


def test_unknown_fallback_criterion_is_refused():
    from ascend_fa.errors import InputError

    with pytest.raises(InputError, match="--linear-fallback-criterion 'logits'"):
        LinearConfig(criterion="logits")


def test_deepseek_mla_plan():
    tok = byte_tokenizer()
    model = tiny_deepseek()
    result = _run(model, tok, quant_type="W8A8_DYNAMIC")
    mods = quantized_modules(model)
    attn = "model.layers.0.self_attn"
    assert f"{attn}.kv_a_proj_with_mqa" in mods and f"{attn}.q_proj" in mods
    # vllm-ascend's MLA keeps kv_b_proj float (mla_v1.py asserts it)
    assert isinstance(model.get_submodule(f"{attn}.kv_b_proj"), nn.Linear)
    assert "model.layers.1.mlp.shared_experts.down_proj" in mods
    assert "model.layers.0.mlp.down_proj" in mods  # dense first layer
    assert result.num_float == 0
    enc = tok(TEXTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert bool(torch.isfinite(model(**enc).logits).all())


def test_unsupported_model_type_is_refused():
    model = tiny_causal_lm(
        "gpt2", attn=None, n_embd=16, n_layer=1, n_head=2, vocab_size=260
    )
    with pytest.raises(UnsupportedError, match="no quantized-linear plan.*gpt2"):
        linear_plan(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_export_and_load_back_bit_equal(tmp_path, dtype):
    """The artifact's tensors, loaded into a fresh model, give the calibrated
    model's logits bit for bit (smoothed norms included)."""
    tok = byte_tokenizer()
    model = tiny_llama()
    _run(model, tok, dtype=dtype)
    want = _logits(model, tok)
    state = export_state(model, {k: v.clone() for k, v in model.state_dict().items()})
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    fresh = tiny_llama()
    placed = load_quantized_model(fresh, load_file(str(path)))
    assert len(placed) == 14 and all(isinstance(m, W8A8Linear) for m in placed.values())
    assert torch.equal(_logits(fresh, tok), want)


@pytest.mark.slow
def test_calibrate_cli_w8a8_artifact_and_eval(tmp_path, capsys):
    src = save_tiny(tmp_path / "llama", "llama")
    out = tmp_path / "art"
    args = [
        "calibrate",
        "--model",
        str(src),
        "--num-samples",
        "6",
        "--max-length",
        "32",
        "--batch-size",
        "3",
        "--heldout",
        "0",
        "--output",
        str(out),
    ]
    assert main([*args, "--linear", "w8a8", "--linear-fallback", "1"]) == 0
    printed = capsys.readouterr().out
    assert "linears: " in printed and "W8A8" in printed
    tensors = read_artifact_tensors(out)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.self_attn.q_proj.quant_bias"].dtype == torch.int32
    rep = json.loads((out / "calibration_report.json").read_text())
    lin = rep["linears"]
    assert lin["quant_type"] == "W8A8" and sum(lin["counts"].values()) == 14
    assert lin["counts"].get("FLOAT", 0) <= 1
    from ascend_fa.evaluation import run_eval

    report = run_eval(src, artifact=out, data=[_text(tmp_path)], window=64)
    res = next(iter(report.results.values()))
    r = res[f"artifact {out.name}"]
    assert 0 <= r.kl < 1 and 0 <= r.top1 <= 1
    # bad flag values: one line, exit 2, nothing written
    bad = tmp_path / "bad"
    assert main([*args[:-1], str(bad), "--linear-fallback", "many"]) == 2
    assert "--linear-fallback must be a number" in capsys.readouterr().err
    assert not bad.exists()
    merged = [*args[:-2], "--merge-into", str(out), "--linear", "w8a8"]
    assert main(merged) == 2
    assert "--merge-into keeps the export's own quantized linears" in (
        capsys.readouterr().err
    )


def _text(tmp_path):
    p = tmp_path / "eval.txt"
    p.write_text(" ".join(TEXTS) * 3)
    return p
