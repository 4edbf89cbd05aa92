"""FA3Processor stages on a small hand-written GQA model and adapter."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from ascend_fa.atb_ops import dequantize_per_head, per_head_qparams, quantize_per_head
from torch import nn

from ascend_fa.calibration import (
    FA3FakeQuant,
    FA3Observer,
    FA3Processor,
    FA3QuantAdapterInterface,
    FA3QuantConfig,
    FA3QuantPlaceHolder,
    find_fa_modules,
    recall_window,
)

H, HKV, D, DIM = 4, 2, 8, 32


class TinyAttention(nn.Module):
    """GQA attention; calls fa_q/fa_k/fa_v on Q, K, V [B, H(kv), S, D] if present."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, H * D, bias=False)
        self.k_proj = nn.Linear(DIM, HKV * D, bias=False)
        self.v_proj = nn.Linear(DIM, HKV * D, bias=False)
        self.o_proj = nn.Linear(H * D, DIM, bias=False)
        self.record: dict[str, torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, H, D).transpose(1, 2)
        k = self.k_proj(x).view(b, s, HKV, D).transpose(1, 2)
        v = self.v_proj(x).view(b, s, HKV, D).transpose(1, 2)
        if self.record is not None:
            self.record.update(q=q.detach(), k=k.detach(), v=v.detach())
        if "fa_q" in self._modules:
            q, k, v = self.fa_q(q, mask), self.fa_k(k, mask), self.fa_v(v, mask)
        k = k.repeat_interleave(H // HKV, dim=1)
        v = v.repeat_interleave(H // HKV, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, H * D))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = TinyAttention()
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x, mask=None):
        x = x + self.self_attn(x, mask)
        return x + self.mlp(x)


class TinyModel(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x, mask=None):
        for layer in self.layers:
            x = layer(x, mask)
        return x


class TinyAdapter(FA3QuantAdapterInterface):
    def __init__(self) -> None:
        self.removed = 0

    def inject_fa3_placeholders(
        self,
        root_name: str,
        root_module: nn.Module,
        should_inject: Callable[[str], bool],
    ) -> None:
        for name, module in root_module.named_modules():
            full = ".".join(p for p in (root_name, name) if p)
            if isinstance(module, TinyAttention) and should_inject(full):
                for branch, heads in (("fa_q", H), ("fa_k", HKV), ("fa_v", HKV)):
                    if branch not in module._modules:
                        module.add_module(branch, FA3QuantPlaceHolder(branch, heads, D))

    def remove_fa3_placeholders(self, root_module: nn.Module) -> None:
        self.removed += 1


def make_model(seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel().eval()


def calib_batches(n: int = 3, b: int = 2, s: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    return [torch.randn(b, s, DIM, generator=g) for _ in range(n)]


def state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_calibration(model, proc, adapter, root_name=""):
    names = proc.preprocess(model, adapter, root_name)
    proc.process(model)
    with torch.no_grad():
        for xb in calib_batches():
            model(xb)
    proc.postprocess(model)
    return names


def test_full_pipeline_and_removal():
    model = make_model()
    x = calib_batches(1)[0]
    with torch.no_grad():
        base = model(x)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = TinyAdapter()
    proc = FA3Processor(FA3QuantConfig(exclude=["layers.0.self_attn"]))

    names = proc.preprocess(model, adapter)
    assert names == ["layers.1.self_attn", "layers.2.self_attn"]
    assert "fa_q" not in model.layers[0].self_attn._modules
    assert isinstance(model.layers[1].self_attn.fa_k, FA3QuantPlaceHolder)
    with torch.no_grad():
        assert torch.equal(model(x), base)  # placeholders are identities

    created = proc.process(model)
    assert created == [
        f"layers.{i}.self_attn.{b}" for i in (1, 2) for b in ("fa_q", "fa_k", "fa_v")
    ]
    assert isinstance(model.layers[2].self_attn.fa_v, FA3Observer)
    with torch.no_grad():
        assert torch.equal(model(x), base)  # observers are identities
    for m in model.modules():  # forget that forward
        if isinstance(m, FA3Observer):
            m.observer.reset()

    # calibration forwards while recording the real Q/K/V of layer 1
    attn = model.layers[1].self_attn
    attn.record = {}
    seen: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": []}
    with torch.no_grad():
        for xb in calib_batches():
            model(xb)
            for key in seen:
                seen[key].append(attn.record[key])
    attn.record = None
    converted = proc.postprocess(model)
    assert len(converted) == 6
    assert isinstance(attn.fa_q, FA3FakeQuant)

    # scales = seed rule on the recorded activations, computed independently
    scales = proc.export_scales(model)
    assert list(scales) == names
    ratios = {"q": 0.9999, "k": 0.9999, "v": 1.0}
    for key in ("q", "k", "v"):
        lo = torch.full((attn.fa_q.num_heads if key == "q" else HKV,), float("inf"))
        hi = -lo
        for t in seen[key]:
            rows = torch.stack([t[:, h].reshape(-1) for h in range(t.shape[1])])
            b_lo, b_hi = recall_window(rows, ratios[key])
            lo, hi = torch.minimum(lo, b_lo), torch.maximum(hi, b_hi)
        exp_scale, exp_offset = per_head_qparams(lo, hi)
        scale, offset = scales["layers.1.self_attn"][f"fa_{key}"]
        assert scale.dtype == torch.float32 and offset.dtype == torch.int8
        assert torch.equal(scale, exp_scale) and torch.equal(offset, exp_offset)

    # fake-quant output = dequantize(quantize(x)) in x's dtype, per head
    q = seen["q"][0].bfloat16()
    fq = attn.fa_q(q)
    assert fq.dtype == torch.bfloat16
    s = scales["layers.1.self_attn"]["fa_q"][0]
    assert torch.equal(
        fq, dequantize_per_head(quantize_per_head(q, s), s, 1, torch.bfloat16)
    )
    # quantized model: close to the original (int8 Q/K/V), not identical
    with torch.no_grad():
        quant = model(x)
    assert not torch.equal(quant, base)
    assert (quant - base).abs().max() < 0.05 * base.abs().max()
    # the scales are module buffers under the artifact's tensor names
    assert torch.equal(
        model.state_dict()["layers.1.self_attn.fa_k.scale"],
        scales["layers.1.self_attn"]["fa_k"][0],
    )

    # re-running any stage changes nothing
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert proc.preprocess(model, adapter) == names
    assert proc.process(model) == [] and proc.postprocess(model) == []
    assert state_equal(before, model.state_dict())

    proc.remove(model)
    assert adapter.removed == 1
    assert find_fa_modules(model) == {}
    assert state_equal(base_state, model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x), base)


def test_inject_twice_changes_nothing():
    model = make_model()
    adapter = TinyAdapter()
    proc = FA3Processor(FA3QuantConfig())
    proc.preprocess(model, adapter)
    first = [(n, type(m).__name__, id(m)) for n, m in model.named_modules()]
    proc.preprocess(model, adapter)
    assert [(n, type(m).__name__, id(m)) for n, m in model.named_modules()] == first
    proc.process(model)
    obs = model.layers[0].self_attn.fa_q
    proc.preprocess(model, adapter)  # an observer is not replaced by a placeholder
    assert model.layers[0].self_attn.fa_q is obs


def test_root_name_and_branch_overrides():
    model = make_model()
    cfg = FA3QuantConfig(
        include=["model.layers.{0,2}.*"],
        method="minmax",
        fa_v={"method": "abs_quantile", "ratio": 0.5},
        fa_k={"accumulate": "pooled", "max_samples": 10_000, "method": "recall_window"},
    )
    proc = FA3Processor(cfg)
    names = run_calibration(model, proc, TinyAdapter(), root_name="model")
    assert names == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    assert list(find_fa_modules(model, "model")) == names
    scales = proc.export_scales(model)
    assert list(scales) == names
    assert all(
        scales[n][b][0].shape == ((H,) if b == "fa_q" else (HKV,))
        for n in names
        for b in ("fa_q", "fa_k", "fa_v")
    )


def test_observer_resume_via_state_dict():
    batches = calib_batches(4)
    model_a, model_b = make_model(), make_model()
    proc_a, proc_b = FA3Processor(), FA3Processor()
    for m, p in ((model_a, proc_a), (model_b, proc_b)):
        p.preprocess(m, TinyAdapter())
        p.process(m)
    with torch.no_grad():
        for xb in batches:
            model_a(xb)
        model_b(batches[0])
        saved = proc_b.state_dict(model_b)
    assert set(saved) == {
        f"layers.{i}.self_attn.{b}" for i in range(3) for b in ("fa_q", "fa_k", "fa_v")
    }
    model_c, proc_c = make_model(), FA3Processor()
    proc_c.preprocess(model_c, TinyAdapter())
    proc_c.process(model_c)
    proc_c.load_state_dict(model_c, saved)
    with torch.no_grad():
        for xb in batches[1:]:
            model_c(xb)
    proc_a.postprocess(model_a)
    proc_c.postprocess(model_c)
    sa, sc = proc_a.export_scales(model_a), proc_c.export_scales(model_c)
    assert all(torch.equal(sa[n][b][0], sc[n][b][0]) for n in sa for b in sa[n])


def test_load_scales_reproduces_calibrated_model():
    model = make_model()
    proc = FA3Processor()
    run_calibration(model, proc, TinyAdapter())
    scales = proc.export_scales(model)
    x = calib_batches(1)[0]
    with torch.no_grad():
        want = model(x)
    fresh = make_model()
    proc2 = FA3Processor()
    proc2.preprocess(fresh, TinyAdapter())
    # artifacts store [H, 1]; runtime loaders may expand to [H, D]: accept both
    converted = {
        n: {
            b: (s.view(-1, 1), o.view(-1, 1))
            if b != "fa_v"
            else (s.view(-1, 1).expand(-1, D), o.view(-1, 1).expand(-1, D))
            for b, (s, o) in br.items()
        }
        for n, br in scales.items()
    }
    loaded = proc2.load_scales(fresh, converted)
    assert len(loaded) == 9
    with torch.no_grad():
        assert torch.equal(fresh(x), want)


def test_token_mask_reaches_observers():
    model = make_model()
    proc = FA3Processor(FA3QuantConfig(ratio=1.0))
    proc.preprocess(model, TinyAdapter())
    proc.process(model)
    x = calib_batches(1)[0]
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    with torch.no_grad():
        model(x, mask)
    obs = model.layers[0].self_attn.fa_k.observer
    assert obs.num_samples.tolist() == [(6 + 4) * D] * HKV


def test_unmatched_pattern_warns_in_preprocess():
    model = make_model()
    proc = FA3Processor(FA3QuantConfig(include=["*"], exclude=["layers.9.self_attn"]))
    with pytest.warns(
        UserWarning,
        match=r"exclude pattern 'layers.9.self_attn' matches "
        r"no attention module \(of 3 considered\)",
    ):
        proc.preprocess(model, TinyAdapter())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FA3Processor(FA3QuantConfig()).preprocess(make_model(), TinyAdapter())


def test_stage_errors():
    model = make_model()
    proc = FA3Processor()
    with pytest.raises(
        ValueError, match="adapter must implement FA3QuantAdapterInterface"
    ):
        proc.preprocess(model, object())
    proc.preprocess(model, TinyAdapter())
    with pytest.raises(
        ValueError, match=r"layers.0.self_attn.fa_q is still a placeholder"
    ):
        proc.postprocess(model)
    with pytest.raises(
        ValueError,
        match=r"export_scales: layers.0.self_attn.fa_q is "
        r"FA3QuantPlaceHolder, not fake-quantized",
    ):
        proc.export_scales(model)
    proc.process(model)
    with pytest.raises(
        ValueError, match=r"'layers.0.self_attn.fa_q': head 0 saw no data"
    ):
        proc.postprocess(model)
    with pytest.raises(
        ValueError,
        match=r"load_state_dict: layers.7.self_attn.fa_q is "
        r"missing",
    ):
        proc.load_state_dict(model, {"layers.7.self_attn.fa_q": {}})


def test_load_scales_errors():
    model = make_model()
    proc = FA3Processor()
    proc.preprocess(model, TinyAdapter())
    ok = torch.ones(H)
    zero = torch.zeros(H, dtype=torch.int8)
    with pytest.raises(ValueError, match="no attention module 'layers.5.self_attn'"):
        proc.load_scales(model, {"layers.5.self_attn": {"fa_q": (ok, zero)}})
    with pytest.raises(ValueError, match=r"layers.0.self_attn has no 'fa_x' point"):
        proc.load_scales(model, {"layers.0.self_attn": {"fa_x": (ok, zero)}})
    with pytest.raises(
        ValueError, match=r"fa_k.scale has shape \(4,\); expected \[2\]"
    ):
        proc.load_scales(model, {"layers.0.self_attn": {"fa_k": (ok, zero)}})
    with pytest.raises(ValueError, match="varies along head_dim"):
        proc.load_scales(
            model, {"layers.0.self_attn": {"fa_q": (torch.rand(H, D) + 0.1, zero)}}
        )
    with pytest.raises(ValueError, match=r"offsets must be 0 \(symmetric INT8\)"):
        proc.load_scales(
            model,
            {"layers.0.self_attn": {"fa_q": (ok, torch.ones(H, dtype=torch.int8))}},
        )
    with pytest.raises(ValueError, match=r"fa_q.scale must be a tensor, got list"):
        proc.load_scales(model, {"layers.0.self_attn": {"fa_q": ([1.0] * H, zero)}})
