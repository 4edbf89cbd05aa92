"""The FA pass riding on the linear pass (:class:`~ascend_fa.calibration.pipeline.
AttentionObserving`): each layer's FA observers are fed only while that layer, its
linears quantized and placed, runs on the calibration batches. The artifact must be
the one of a separate FA pass over the quantized model, byte for byte, on tiny real
checkpoints with padded batches (the token mask per batch matters)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402

from ascend_fa.calibration import job as job_mod  # noqa: E402
from ascend_fa.calibration import pipeline  # noqa: E402
from ascend_fa.calibration.job import calibrate  # noqa: E402
from ascend_fa.linear import LinearConfig  # noqa: E402
from ascend_fa.linear import calibrate_linears as linear_calibrate  # noqa: E402

#: Samples of very different lengths: the batches are padded.
TEXTS = [
    "The river ran north past the mill and the old stone bridge at dusk.",
    "def add(a, b):\n    return a + b",
    "Tables: 12, 7, 19, 44, 3.",
    "She said the train would be late again, so they walked along the "
    "harbour and counted the boats that came in before the rain.",
    "for i in range(10): print(i * i)",
    "A short one.",
    "Prices rose 3.2 % in May; wages rose 2.9 %, and rents 4.1 % over the year.",
    "The committee met twice and agreed on nothing but the date of its next "
    "meeting, which it then moved.",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("riding")
    data = root / "calib.txt"
    data.write_text("\n\n".join(TEXTS) + "\n")
    return {
        "llama": save_tiny(root / "llama", "llama"),
        "deepseek_v3": save_tiny(root / "ds", "deepseek_v3"),
        "data": data,
    }


def _calibrate(model: Path, out: Path, data: Path, **extra) -> None:
    calibrate(
        model,
        output=out,
        calib_data=data,
        num_samples=8,
        max_length=48,
        batch_size=3,
        heldout=0,
        picture_report=False,
        progress=False,
        **extra,
    )


def _files(out: Path) -> dict[str, bytes]:
    # the report holds timings; everything else must be equal byte for byte
    return {
        p.name: p.read_bytes()
        for p in out.iterdir()
        if p.is_file() and p.name != "calibration_report.json"
    }


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("llama", {"target": "mindie"}),  # static W8A8 + FAQuant, layer fallback
        ("llama", {"target": "mindie", "linear": "w8a8_dynamic"}),
        ("deepseek_v3", {"target": "mindie"}),  # MLA: FAKQuant
        # C8 K/V scales through the KV wrapper of the FA points
        (
            "llama",
            {"target": "vllm-ascend", "consumer_version": "main", "linear": "w8a8"},
        ),
    ],
)
def test_riding_fa_pass_writes_the_separate_passes_artifact(
    setup, tmp_path, monkeypatch, kind, extra
):
    rode = []
    real = pipeline.AttentionObserving.propagate

    def spy(self, index, layer, inputs):
        rode.append(index)
        return real(self, index, layer, inputs)

    monkeypatch.setattr(pipeline.AttentionObserving, "propagate", spy)
    _calibrate(setup[kind], tmp_path / "riding", setup["data"], **extra)
    layers = transformers.AutoConfig.from_pretrained(setup[kind]).num_hidden_layers
    assert rode == list(range(layers))
    monkeypatch.setattr(job_mod, "attention_on_linears", lambda *a: None)
    rode.clear()
    _calibrate(setup[kind], tmp_path / "separate", setup["data"], **extra)
    assert rode == []
    riding, separate = _files(tmp_path / "riding"), _files(tmp_path / "separate")
    assert set(riding) == set(separate)
    for name in riding:
        assert riding[name] == separate[name], name


def test_observers_outside_the_propagation_would_change_the_scales(setup, tmp_path):
    # Counter-example: with the observers left active through the whole linear
    # pass (statistics and fallback forwards of float linears), the scales differ
    # from the separate pass's, so the equality above is not vacuous.
    from ascend_fa.calibration.recipe import load_recipe
    from ascend_fa.models import load_model

    texts = TEXTS
    recipe = load_recipe(job_mod.default_recipe_path())
    config = LinearConfig("W8A8", torch.bfloat16, scan_samples=2, scan_tokens=16)
    kw = dict(max_length=48, batch_size=3, progress=False)
    net_a = load_model(str(setup["llama"]), None)
    net_b = load_model(str(setup["llama"]), None)
    tok = net_a.tokenizer
    _lin, good, _t = pipeline.calibrate_with_linears(
        net_a.model, tok, texts, config, recipe=recipe, **kw
    )
    # room for the extra forwards (the exact cap alone refuses them: see below)
    obs = pipeline.AttentionObserving(net_b.model, recipe, 4 * len(texts), 48)
    obs._stack.close()  # observers in place for every forward of the linear pass
    pipeline.calibrate_linears(net_b.model, tok, texts, config, **kw)
    bad = obs.result()
    a, b = good.export_scales(net_a.model), bad.export_scales(net_b.model)
    assert set(a) == set(b)
    assert any(
        not torch.equal(a[attn][branch][0], b[attn][branch][0])
        for attn in a
        for branch in a[attn]
    )
    net_c = load_model(str(setup["llama"]), None)
    obs = pipeline.AttentionObserving(net_c.model, recipe, len(texts), 48)
    obs._stack.close()
    with pytest.raises(ValueError, match="exceed max_samples"):
        pipeline.calibrate_linears(net_c.model, tok, texts, config, **kw)


def test_a_model_whose_layers_get_different_masks_cannot_ride(setup):
    from ascend_fa.calibration.recipe import load_recipe
    from ascend_fa.models import load_model

    net = load_model(str(setup["llama"]), None).model
    net.config.layer_types = ["full_attention", "sliding_attention"] + ["x"] * (
        net.config.num_hidden_layers - 2
    )
    recipe = load_recipe(job_mod.default_recipe_path())
    with pytest.raises(ValueError, match="cannot ride on the linear pass"):
        pipeline.AttentionObserving(net, recipe, 4, 32)


def test_the_kl_criterion_takes_no_propagate(setup):
    from ascend_fa.models import load_model

    net = load_model(str(setup["llama"]), None).model
    config = LinearConfig("W8A8", torch.bfloat16, criterion="kl")
    batches = [{"input_ids": torch.randint(0, 250, (2, 8))}]
    with pytest.raises(ValueError, match="propagate needs criterion 'layer'"):
        linear_calibrate(
            net, batches, config, scan_batches=batches, propagate=lambda *a: None
        )
