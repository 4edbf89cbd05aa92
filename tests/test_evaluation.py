"""Accuracy evaluation: structure, exact controls, hand-computed references, the
dynamic upper bound vs per-tensor, artifact reading and bad inputs, the CLI."""

from __future__ import annotations

import json
import math

import builders
import pytest
import torch
import torch.nn.functional as F
import transformers
from builders import byte_tokenizer
from safetensors.torch import save_file

from ascend_fa import evaluation as ev
from ascend_fa.adapters import get_adapter
from ascend_fa.artifact import fa_tensors
from ascend_fa.calibration import FA3Processor, FA3QuantConfig, find_fa_modules
from ascend_fa.calibration import methods as cm
from ascend_fa.calibration.search import SearchConfig
from ascend_fa.cli import main

ATTN = [f"model.layers.{i}.self_attn" for i in range(2)]
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Numbers: 3.14159, 2.71828, 1.41421 and 42; totals 17 + 25 = 42.",
    "User: how far is the station?\nAssistant: about twelve kilometres north.",
    "A short line of prose, then another one with more words in it.",
    "for (int i = 0; i < n; i++) { sum += a[i] * b[i]; }",
]


def tiny_llama(seed: int = 0, head_gains: bool = False):
    """hidden 64, 2 layers, 4 query heads, 2 KV heads (head_dim 16).

    ``head_gains`` multiplies each head's q/k/v projection rows by very different
    factors, so per-head ranges differ by orders of magnitude.
    """
    model = builders.tiny_llama(seed)
    if head_gains:
        with torch.no_grad():
            for layer in model.model.layers:
                a = layer.self_attn
                q = torch.tensor([1.0, 30.0, 0.05, 4.0]).repeat_interleave(16)
                kv = torch.tensor([0.05, 20.0]).repeat_interleave(16)
                a.q_proj.weight.mul_(q[:, None])
                a.k_proj.weight.mul_(kv[:, None])
                a.v_proj.weight.mul_(kv.flip(0)[:, None])
    return model


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def windows(tok):
    return ev.token_windows(tok, "\n\n".join(TEXTS), window=96)


def minmax_scales(model, tok):
    m = cm.MethodSpec("minmax", FA3QuantConfig(method="minmax"))
    return cm.calibrate_methods(model, tok, TEXTS, [m], max_length=64)["minmax"]


# -------------------------------------------------------------- structure
def test_structure_and_float_control_is_exact(tok, windows):
    model = tiny_llama()
    scales = minmax_scales(model, tok)
    res = ev.evaluate(
        model, windows, {"float": "float", "mm": scales, "dyn": "dynamic"}, batch_size=2
    )
    assert list(res) == ["float", "mm", "dyn"]
    tokens = sum(w.numel() - 1 for w in windows)
    for r in res.values():
        assert r.tokens == tokens
        assert list(r.layer_cosine) == ATTN and list(r.layer_rel_l1) == ATTN
        d = r.to_dict()
        assert d["perplexity_delta_pct"] == r.ppl_delta_pct
        assert set(d["layers"]) == set(ATTN)
    # Quantization disabled: the same forward twice, bit for bit.
    f = res["float"]
    assert f.perplexity == f.perplexity_float and f.ppl_delta_pct == 0.0
    assert all(c == 1.0 for c in f.layer_cosine.values())
    assert all(v == 0.0 for v in f.layer_rel_l1.values())
    # Real quantization moves things, but only a little.
    for key in ("mm", "dyn"):
        assert 0.99 < res[key].mean_cosine < 1.0
        assert 0.0 < res[key].mean_rel_l1 < 0.1
    # The model is left without FA points (evaluate injected them itself).
    assert not find_fa_modules(model)


def test_matches_hand_computed_reference(tok, windows):
    """Cosine / rel-L1 of each attention output and the perplexity, recomputed here
    from the processor's own fake-quant modules and plain cross-entropy."""
    model = tiny_llama(1)
    scales = minmax_scales(model, tok)
    res = ev.evaluate(model, windows, {"mm": scales})["mm"]

    captured: dict[str, list[torch.Tensor]] = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda _m, _a, out, n=n: captured.setdefault(n, []).append(
                out[0].detach().double()
            )
        )
        for n in ATTN
    ]

    def run():
        nll, count = 0.0, 0
        with torch.no_grad():
            for w in windows:
                logits = model(input_ids=w[None], use_cache=False).logits[0]
                nll += float(
                    F.cross_entropy(logits[:-1].double(), w[1:], reduction="sum")
                )
                count += w.numel() - 1
        return math.exp(nll / count)

    ppl_float = run()
    ref = {n: torch.cat(v, dim=1) for n, v in captured.items()}
    captured.clear()
    adapter = get_adapter(model)
    proc = FA3Processor()
    proc.preprocess(model, adapter)
    proc.load_scales(model, scales)
    ppl_fq = run()
    proc.remove(model, adapter)
    for h in hooks:
        h.remove()
    # evaluate takes log_softmax in fp32, the reference in fp64: ~1e-7 apart.
    assert math.isclose(res.perplexity_float, ppl_float, rel_tol=1e-6)
    assert math.isclose(res.perplexity, ppl_fq, rel_tol=1e-6)
    assert res.perplexity != res.perplexity_float
    for n in ATTN:
        a, b = ref[n].flatten(), torch.cat(captured[n], dim=1).flatten()
        cos = float(a @ b / (a.norm() * b.norm()))
        rel = float((a - b).abs().sum() / a.abs().sum())
        assert math.isclose(res.layer_cosine[n], cos, rel_tol=1e-12)
        assert math.isclose(res.layer_rel_l1[n], rel, rel_tol=1e-9)


def test_dynamic_fake_quant_matches_naive_loop(rng):
    x = (
        torch.randn(2, 3, 5, 8, generator=rng)
        * torch.tensor([1e-3, 1.0, 50.0])[None, :, None, None]
    )
    x[1, 2, 4] = 0.0  # an all-zero token: scale floors at 2**-23, codes are 0
    got = ev.DynamicFakeQuant("fa_q", 3)(x)
    ref = torch.empty_like(x)
    for b in range(2):
        for h in range(3):
            for s in range(5):
                row = x[b, h, s]
                scale = max(float(row.abs().max()) / 127.0, 2.0**-23)
                scale = torch.tensor(scale, dtype=torch.float32)
                ref[b, h, s] = torch.clamp(torch.round(row / scale), -128, 127) * scale
    assert torch.equal(got, ref)
    bf = ev.DynamicFakeQuant("fa_k", 3)(x.bfloat16())
    assert bf.dtype == torch.bfloat16


def test_dynamic_beats_per_head_beats_per_tensor_on_unequal_heads(tok, windows):
    model = tiny_llama(2, head_gains=True)
    methods = [
        cm.MethodSpec("per-head", FA3QuantConfig(method="minmax")),
        cm.MethodSpec("per-tensor", FA3QuantConfig(method="minmax"), per_tensor=True),
        cm.MethodSpec("dynamic", dynamic=True),
    ]
    specs = cm.calibrate_methods(model, tok, TEXTS, methods, max_length=64)
    assert specs["dynamic"] == "dynamic"
    res = ev.evaluate(model, windows, specs)
    d, h, t = res["dynamic"], res["per-head"], res["per-tensor"]
    assert d.mean_cosine > h.mean_cosine > t.mean_cosine
    assert d.mean_rel_l1 < h.mean_rel_l1 < t.mean_rel_l1
    # One scale per tensor really is one scale: the largest per-head one.
    for name, entry in specs["per-tensor"].items():
        for b, (s, off) in entry.items():
            assert torch.equal(
                s, torch.full_like(s, float(specs["per-head"][name][b][0].max()))
            )
            assert torch.equal(off, torch.zeros_like(off))


def test_calibrate_methods_one_pass_matches_processor(tok):
    """The single-pass fan-out gives the very scales FA3Processor computes."""
    model = tiny_llama(3)
    cfg = FA3QuantConfig()
    specs = cm.calibrate_methods(
        model,
        tok,
        TEXTS,
        [
            cm.MethodSpec("rw", cfg),
            cm.MethodSpec("search", cfg, search=SearchConfig(rows=4, tokens=64)),
        ],
        max_length=64,
    )
    from ascend_fa.calibration import Recipe
    from ascend_fa.calibration.pipeline import calibrate_model

    procs, adapter, _ = calibrate_model(
        model, tok, TEXTS, recipe=Recipe(processors=[cfg]), max_length=64, batch_size=4
    )
    want = procs[0].export_scales(model)
    procs[0].remove(model, adapter)
    for name in ATTN:
        for b in ("fa_q", "fa_k", "fa_v"):
            assert torch.equal(specs["rw"][name][b][0], want[name][b][0])
            # the search only ever picks grid multiples of the start
            ratio = specs["search"][name][b][0] / want[name][b][0]
            assert all(
                any(
                    math.isclose(float(r), g, rel_tol=1e-6) for g in SearchConfig().grid
                )
                for r in ratio
            )


# --------------------------------------------------------------- artifacts
def write_artifact(path, scales):
    path.mkdir()
    save_file(fa_tensors(scales), str(path / "quant_model_weights.safetensors"))
    return path


def test_artifact_round_trip(tok, windows, tmp_path):
    model = tiny_llama()
    scales = minmax_scales(model, tok)
    art = write_artifact(tmp_path / "art", scales)
    read = ev.read_artifact_scales(art)
    for name in ATTN:
        for b in ("fa_q", "fa_k", "fa_v"):
            assert torch.equal(read[name][b][0], scales[name][b][0])
    a = ev.evaluate(model, windows[:1], {"x": read})["x"]
    b = ev.evaluate(model, windows[:1], {"x": scales})["x"]
    assert a.layer_cosine == b.layer_cosine and a.perplexity == b.perplexity


def test_bad_inputs(tok, windows, tmp_path):
    model = tiny_llama()
    scales = minmax_scales(model, tok)
    with pytest.raises(FileNotFoundError, match="artifact not found"):
        ev.read_artifact_scales(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no FA scales"):
        ev.read_artifact_scales(tmp_path / "empty")
    bad = {n: dict(e) for n, e in scales.items()}
    s, o = bad[ATTN[0]]["fa_k"]
    bad[ATTN[0]]["fa_k"] = (torch.cat([s, s]), torch.cat([o, o]))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn\.fa_k\.scale "
        r"has shape \(4,\) but the model's fa_k has 2 heads",
    ):
        ev.evaluate(model, windows, {"bad": bad})
    other = {"model.layers.7.self_attn": scales[ATTN[0]]}
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.7\.self_attn\.fa_q\.scale: "
        "the model has no attention module",
    ):
        ev.evaluate(model, windows, {"bad": other})
    zero = {ATTN[0]: dict(scales[ATTN[0]], fa_v=(torch.zeros(2), o))}
    with pytest.raises(ValueError, match=r"fa_v\.scale must be finite and > 0"):
        ev.evaluate(model, windows, {"bad": zero})
    with pytest.raises(ValueError, match="no FA scales to evaluate"):
        ev.evaluate(model, windows, {"bad": {}})
    with pytest.raises(ValueError, match="must be a scale map, 'dynamic' or 'float'"):
        ev.evaluate(model, windows, {"bad": "static"})
    with pytest.raises(ValueError, match="no evaluation windows"):
        ev.evaluate(model, [], {"f": "float"})
    with pytest.raises(ValueError, match="nothing to evaluate"):
        ev.evaluate(model, windows, {})
    # A failed check leaves the model as it was.
    assert not find_fa_modules(model)
    with pytest.raises(ValueError, match="unknown evaluation set 'poems'"):
        ev.eval_text_path("poems")
    with pytest.raises(FileNotFoundError, match="evaluation data not found"):
        ev.load_eval_text(tmp_path / "nope.txt")
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="evaluation file is empty"):
        ev.load_eval_text(tmp_path / "blank.txt")
    with pytest.raises(ValueError, match="window must be >= 2"):
        ev.token_windows(tok, "abc", window=1)
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        ev.token_windows(tok, "a")


def test_token_windows(tok):
    ids = tok("x" * 250, return_tensors="pt")["input_ids"][0]
    w = ev.token_windows(tok, "x" * 250, window=100)
    assert [t.numel() for t in w] == [100, 100]  # 50-token tail < min_last 64
    assert torch.equal(torch.cat(w), ids[:200])
    assert [
        t.numel() for t in ev.token_windows(tok, "x" * 250, window=100, min_last=10)
    ] == [100, 100, 50]
    assert [
        t.numel() for t in ev.token_windows(tok, "x" * 250, window=100, max_tokens=120)
    ] == [100]


def test_packaged_eval_sets_are_held_out():
    from ascend_fa.calibration.data import load_calib_texts

    calib = "\n".join(load_calib_texts())
    for name in ev.EVAL_SETS:
        text = ev.load_eval_text(name)
        assert len(text) > 8000, name
        lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 30]
        assert lines and not [ln for ln in lines if ln in calib], name


# --------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(4).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_artifact_and_compare(model_dir, tok, tmp_path, capsys):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    art = write_artifact(tmp_path / "art", minmax_scales(model, tok))
    data = tmp_path / "held.txt"
    data.write_text("\n\n".join(TEXTS[::-1]))
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 2))
    out = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--artifact",
            str(art),
            "--data",
            str(data),
            "--window",
            "64",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "artifact art" in text and "dynamic per-token-per-head" in text
    assert "held ppl" in text
    payload = json.loads(out.read_text())
    r = payload["results"]["held"]["artifact art"]
    assert set(r["layers"]) == set(ATTN) and 0.9 < r["mean_attention_output_cosine"]
    rc = main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--compare-methods",
            "--calib-data",
            str(calib),
            "--num-samples",
            "6",
            "--max-length",
            "48",
            "--data",
            str(data),
            "--window",
            "64",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for m in cm.default_methods(1 << 20):
        assert m.name in text
    assert len(json.loads(out.read_text())["results"]["held"]) == len(
        cm.default_methods(1)
    )


def test_cli_errors(model_dir, tmp_path, capsys):
    assert main(["eval", "--model", str(model_dir)]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert main(["eval", "--artifact", str(tmp_path / "none")]) == 2
    assert "artifact not found" in capsys.readouterr().err
    assert main(["eval", "--compare-methods", "--window", "0"]) == 2
    assert "--window must be > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_search_and_dynamic():
    pytest.importorskip("gguf")
    from ascend_fa.calibration.data import load_calib_texts
    from ascend_fa.models import ModelNotFoundError, load_model

    try:
        lm = load_model()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    calib = cm.calibration_split(load_calib_texts(), 4)
    cfg = FA3QuantConfig()
    specs = cm.calibrate_methods(
        lm.model,
        lm.tokenizer,
        calib,
        [
            cm.MethodSpec("default", cfg),
            cm.MethodSpec("search", cfg, search=SearchConfig(rows=4, tokens=128)),
            cm.MethodSpec("dynamic", dynamic=True),
        ],
    )
    win = ev.token_windows(
        lm.tokenizer, ev.load_eval_text("prose"), window=128, max_tokens=128
    )
    res = ev.evaluate(lm.model, win, specs)
    assert len(res["default"].layer_cosine) == 30
    for r in res.values():
        assert abs(r.ppl_delta_pct) < 3.0 and r.mean_cosine > 0.99
    assert res["dynamic"].mean_cosine > res["default"].mean_cosine


def test_token_kl_is_never_negative_for_equal_distributions():
    # Shifted logits are the same distribution; fp32 log-softmax rounding leaves
    # about half of the positions at -1e-8 before the clamp, and their sum (the
    # printed KL of a float row) negative for some of these seeds.
    from ascend_fa.metrics import token_kl

    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        ref = torch.randn(1, 64, 4096, generator=g) * 5
        kl, same, count = token_kl(ref, ref + 3.0)
        assert 0.0 <= kl < 1e-4
        assert (same, count) == (64, 64)
    # A real difference is still measured.
    ref = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    kl, _, _ = token_kl(ref, ref.flip(-1))
    assert kl > 1.0


def test_dtype_refusals(capsys):
    from ascend_fa.errors import InputError

    with pytest.raises(InputError, match="--dtype must be one of fp32, fp64"):
        ev.run_eval(compare_methods=True, dtype="bf16")
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--compare-methods", "--dtype", "fp16"])
    assert exc.value.code == 2
    assert "--dtype: invalid choice: 'fp16'" in capsys.readouterr().err


def test_long_eval_sets_extend_the_short_ones():
    from ascend_fa.eval_data import LONG_EVAL_SETS, data_source, load_eval_text

    for name in ("prose", "code"):
        short, long = load_eval_text(name), load_eval_text(f"{name}-long")
        assert long.startswith(short.rstrip("\n")) and len(long) > 1.5 * len(short)
    assert set(LONG_EVAL_SETS) == {"prose-long", "code-long"}
    # --data takes the packaged names as well as files
    assert data_source("code-long") is None and data_source("prose") is None
    assert data_source("notes.txt") == __import__("pathlib").Path("notes.txt")
