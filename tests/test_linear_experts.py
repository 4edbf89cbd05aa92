"""DeepSeek routed experts as W8A8_DYNAMIC (``ascend_fa.linear.experts``).

The codes match a naive per-row quantizer bit for bit; the forward matches a token-
by-token reference written from the golden ops (``*_ref``); the experts stay within
an error budget of the float experts; the export round-trips; and a calibration
for vllm-ascend writes every expert's projections under the checkpoint names, which
``inspect`` accepts and ``eval``'s loader turns back into the same module.
"""

from __future__ import annotations

import json

import pytest
import torch
from ascend_fa.atb_ops.linear import dynamic_quant_ref, quant_matmul_dynamic_ref
from builders import save_tiny, tiny_deepseek
from safetensors import safe_open

from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact
from ascend_fa.cli import main
from ascend_fa.errors import FileFormatError
from ascend_fa.linear import W8A8DynamicExperts, artifact_model, linear_plan
from ascend_fa.linear.modules import dtype_round_up

DT = torch.float32


def _experts():
    torch.manual_seed(0)
    return tiny_deepseek().model.layers[1].mlp.experts


def _naive_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row: scale = max|row| / 127 rounded up to the dtype, codes round."""
    codes, scales = torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[0])
    for r in range(w.shape[0]):
        s = dtype_round_up(torch.tensor([float(w[r].abs().max()) / 127.0]), DT)[0]
        scales[r] = s
        codes[r] = torch.clamp(torch.round(w[r] / s), -127, 127).to(torch.int8)
    return codes, scales


def test_codes_are_each_experts_rows_quantized():
    ex = _experts()
    q = W8A8DynamicExperts.from_float(ex, dtype=DT, name="experts")
    for e in range(ex.gate_up_proj.shape[0]):
        for mine, scale, w in (
            (q.gate_up_weight[e], q.gate_up_scale[e], ex.gate_up_proj[e]),
            (q.down_weight[e], q.down_scale[e], ex.down_proj[e]),
        ):
            codes, scales = _naive_codes(w.detach())
            assert torch.equal(mine, codes) and torch.equal(scale, scales)


def test_forward_is_the_golden_ops_token_by_token_and_close_to_float():
    ex = _experts()
    q = W8A8DynamicExperts.from_float(ex, dtype=DT)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, ex.hidden_dim, generator=g)
    idx = torch.tensor([[0, 1], [1, 3], [2, 0], [3, 2], [0, 3], [1, 2], [4, 0]])
    weights = torch.rand(7, 2, generator=g)  # expert 4: transformers' "none" index
    got = q(x, idx, weights)
    want = torch.zeros_like(x)
    i = q.intermediate
    for t in range(7):
        for slot in range(2):
            e = int(idx[t, slot])
            if e >= q.num_experts:
                continue
            xq, s = dynamic_quant_ref(x[t : t + 1])
            gu = quant_matmul_dynamic_ref(
                xq, q.gate_up_weight[e], q.gate_up_scale[e], s
            )
            h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
            hq, hs = dynamic_quant_ref(h)
            y = quant_matmul_dynamic_ref(hq, q.down_weight[e], q.down_scale[e], hs)
            want[t] += (y * weights[t, slot])[0]
    # the same integer products and scalings; only the order of the final sums
    # over a token's experts differs
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    # against the float experts (routed to real experts only: transformers'
    # implementations treat the "none" index differently)
    idx[6, 0] = 3
    with torch.no_grad():
        got, ref = q(x, idx, weights), ex(x, idx, weights)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.03, rel  # int8 weights and per-token int8 activations


def test_export_round_trips_and_bad_tensors_are_named():
    ex = _experts()
    q = W8A8DynamicExperts.from_float(ex, dtype=torch.bfloat16)
    t = q.export_tensors("m.experts")
    n_int = ex.gate_up_proj.shape[1] // 2
    assert t["m.experts.2.up_proj.weight"].dtype == torch.int8
    assert t["m.experts.2.up_proj.weight_scale"].shape == (n_int, 1)
    assert t["m.experts.2.up_proj.weight_scale"].dtype == torch.bfloat16
    assert not t["m.experts.3.down_proj.weight_offset"].any()
    back = W8A8DynamicExperts.from_tensors(
        "m.experts", t, torch.bfloat16, act_fn=ex.act_fn, num_experts=4
    )
    for b in W8A8DynamicExperts.BUFFERS:
        assert torch.equal(getattr(back, b), getattr(q, b)), b
    del t["m.experts.1.gate_proj.weight_scale"]
    with pytest.raises(FileFormatError, match=r"m\.experts\.1\.gate_proj"):
        W8A8DynamicExperts.from_tensors(
            "m.experts", t, torch.bfloat16, act_fn=ex.act_fn, num_experts=4
        )


def test_plan_has_the_routed_experts_of_moe_layers_only():
    plans = linear_plan(tiny_deepseek())
    assert plans[0].experts is None  # first_k_dense_replace: a dense MLP
    assert plans[1].experts.name == "model.layers.1.mlp.experts"
    assert plans[1].experts.size == 3 * 4


def test_vllm_ascend_calibration_quantizes_every_expert(tmp_path, capsys):
    src = save_tiny(tmp_path / "ds", "deepseek_v3", dtype=torch.bfloat16)
    out = tmp_path / "out"
    args = ["--num-samples", "4", "--max-length", "32", "--batch-size", "2"]
    rc = main(
        ["calibrate", "--model", str(src), *args, "--heldout", "1", "--no-report"]
        + ["-q", "--target", "vllm-ascend", "--output", str(out)]
    )
    assert rc == 0, capsys.readouterr().err
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for s in ("weight", "weight_scale", "weight_offset"):
                key = f"model.layers.1.mlp.experts.{e}.{proj}.{s}"
                assert desc[key] == "W8A8_DYNAMIC", key
    assert not [k for k in desc if "gate_up_proj" in k]
    with safe_open(str(out / "quant_model_weights.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight")
        s = f.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight_scale")
    assert w.dtype == torch.int8 and s.dtype == torch.bfloat16
    assert s.shape == (w.shape[0], 1)
    report = inspect_artifact(out, target="vllm-ascend")
    assert report["valid"], report["findings"]
    # eval's loader rebuilds the experts module from the per-expert tensors
    from ascend_fa.models import load_model

    loaded = load_model(str(src))
    model = artifact_model(loaded.model, out)
    placed = model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(placed, W8A8DynamicExperts)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = loaded.model(input_ids=ids).logits
    assert torch.isfinite(a).all() and not torch.equal(a, b)
    assert float((a - b).norm() / b.norm()) < 0.1
