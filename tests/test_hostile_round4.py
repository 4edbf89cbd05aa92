"""Hostile inputs, round 4: an artifact incomplete against its own config.json,
errors that must name their file and tensor, one judge of provenance, and the
per-module attention metric of ``eval`` on a rotated artifact.

The artifacts are msModelSlim-shaped W8A8 exports of a tiny Llama
(:func:`builders.msmodelslim_export`), valid as written, broken by hand one way
each. ``inspect`` must find each break in one line naming the tensor (exit 1);
the vLLM plugin refuses the same artifacts at start-up through the same check
(the real-vLLM side is ``tests/test_vllm_hostile_round4.py``, slow).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from builders import msmodelslim_export, save_tiny, tiny_llama  # noqa: E402

from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact  # noqa: E402
from ascend_fa.artifact.architecture import expected_tensors  # noqa: E402
from ascend_fa.artifact.merge import check_merge_export  # noqa: E402
from ascend_fa.artifact.provenance import (  # noqa: E402
    SOURCE_METADATA_KEY,
    check_artifact_model,
)
from ascend_fa.cli import main  # noqa: E402
from ascend_fa.errors import InputError  # noqa: E402

L1 = "model.layers.1"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("round4")
    llama = save_tiny(root / "llama", "llama")
    export = root / "export"
    msmodelslim_export(export, llama)
    return {"root": root, "llama": llama, "export": export}


def _broken(src: Path, dst: Path, tensors=None, desc=None, config=None) -> Path:
    """``src`` copied to ``dst``, its weights, description and config.json each
    edited in place by the given function."""
    shutil.copytree(src, dst)
    if tensors is not None:
        for f in dst.glob("*.safetensors"):
            t = load_file(f)
            tensors(t)
            save_file(t, f, metadata={"format": "pt"})
    for name, edit in ((DESCRIPTION_FILE, desc), ("config.json", config)):
        if edit is not None:
            path = dst / name
            data = json.loads(path.read_text())
            edit(data)
            path.write_text(json.dumps(data))
    return dst


def _drop(prefix: str):
    def edit(mapping: dict) -> None:
        for key in [k for k in mapping if k.startswith(prefix)]:
            del mapping[key]

    return edit


def _short(name: str):
    def edit(t: dict) -> None:
        t[name] = t[name][:-1].contiguous()

    return edit


def _transposed(name: str):
    def edit(t: dict) -> None:
        t[name] = t[name].t().contiguous()

    return edit


#: (case, weights edit, description edit, config edit, the finding's tensor and
#: words). The three silent cases first: vLLM served each of them with wrong
#: output before the start-up check compared the artifact with the architecture.
CASES = [
    ("missing_norm", _drop(f"{L1}.input_layernorm.weight"),
     _drop(f"{L1}.input_layernorm.weight"), None,
     f"{L1}.input_layernorm.weight: missing from the weights"),
    ("missing_linear", _drop(f"{L1}.mlp.down_proj."), _drop(f"{L1}.mlp.down_proj."),
     None, f"{L1}.mlp.down_proj.weight: missing from the weights"),
    ("intermediate_size", None, None, lambda c: c.update(intermediate_size=32),
     "mlp.gate_proj.weight: shape [64, 48] in the weights, config.json implies "
     "[32, 48]"),
    ("float_row_short", _short("model.layers.0.input_layernorm.weight"), None, None,
     "model.layers.0.input_layernorm.weight: shape [47] in the weights, config.json "
     "implies [48]"),
    ("int8_transposed", _transposed(f"{L1}.mlp.down_proj.weight"), None, None,
     f"{L1}.mlp.down_proj.weight: shape [64, 48] in the weights, config.json "
     "implies [48, 64]"),
    ("embedding_short", _short("model.embed_tokens.weight"), None, None,
     "model.embed_tokens.weight: shape"),
]  # fmt: skip


@pytest.mark.parametrize("case, tensors, desc, config, needle", CASES)
def test_incomplete_artifact_is_a_finding(setup, tmp_path, capsys, case, tensors,
                                          desc, config, needle):  # fmt: skip
    bad = _broken(setup["export"], tmp_path / case, tensors, desc, config)
    result = inspect_artifact(bad)
    assert not result["valid"]
    hits = [f for f in result["findings"] if needle in f]
    assert hits, result["findings"]
    assert all("\n" not in f for f in result["findings"])
    assert main(["inspect", str(bad)]) == 1
    assert needle in capsys.readouterr().out


def test_the_intact_export_is_complete(setup):
    result = inspect_artifact(setup["export"])
    assert result["valid"], result["findings"]
    want = expected_tensors(json.loads((setup["llama"] / "config.json").read_text()))
    # every parameter of the architecture: embeddings, norms, linears, head
    assert f"{L1}.input_layernorm.weight" in want
    assert f"{L1}.post_attention_layernorm.weight" in want
    assert "model.norm.weight" in want and "model.embed_tokens.weight" in want
    assert want[f"{L1}.mlp.down_proj.weight"] == [48, 64]


def test_a_tied_head_is_not_expected(setup):
    cfg = json.loads((setup["llama"] / "config.json").read_text())
    assert "lm_head.weight" in expected_tensors({**cfg, "tie_word_embeddings": False})
    assert "lm_head.weight" not in expected_tensors(
        {**cfg, "tie_word_embeddings": True}
    )


def test_unbuildable_config_is_one_finding(setup, tmp_path):
    bad = _broken(setup["export"], tmp_path / "heads", config=lambda c: c.update(
        num_attention_heads=5, head_dim=None))  # fmt: skip
    found = inspect_artifact(bad)["findings"]
    assert found and all("\n" not in f for f in found)


def test_description_not_json_names_file_and_position(setup, tmp_path, capsys):
    bad = tmp_path / "not_json"
    shutil.copytree(setup["export"], bad)
    (bad / DESCRIPTION_FILE).write_text('{"model_quant_type": "W8A8",\n  bad }')
    result = inspect_artifact(bad)
    assert any(
        f.startswith(f"{DESCRIPTION_FILE}: invalid JSON") and "line 2 column 3" in f
        for f in result["findings"]
    ), result["findings"]
    # the plugin reads it with the library's reader (vLLM's json.load names no
    # file): the file and the position
    from ascend_fa.artifact.reader import read_description
    from ascend_fa.errors import FileFormatError

    with pytest.raises(FileFormatError) as e:
        read_description(bad)
    assert str(bad / DESCRIPTION_FILE) in str(e.value)
    assert "line 2 column 3" in str(e.value)


def test_quantization_config_beside_a_description_is_a_finding(setup, tmp_path):
    bad = _broken(setup["export"], tmp_path / "qc", config=lambda c: c.update(
        quantization_config={"quant_method": "fp8"}))  # fmt: skip
    found = inspect_artifact(bad)["findings"]
    assert any(
        "quantization_config present" in f and "never reads" in f for f in found
    ), found


def _with_meta(**meta):
    def edit(desc: dict) -> None:
        desc["metadata"] = {**desc.get("metadata", {}), **meta}

    return edit


def test_unknown_recorded_target_is_a_finding(setup, tmp_path, capsys):
    bad = _broken(setup["export"], tmp_path / "t",
                  desc=_with_meta(ascend_fa_target="tensorrt"))  # fmt: skip
    result = inspect_artifact(bad)
    assert not result["valid"]
    assert any("'tensorrt' is not a known target" in f for f in result["findings"])
    assert main(["inspect", str(bad)]) == 1


def test_provenance_against_config_is_one_rule(setup, tmp_path):
    """A record of a Qwen3 source in a Llama artifact: ``inspect`` finds it,
    ``eval`` / ``emulate`` (:func:`check_artifact_model`) and ``--merge-into``
    refuse it, all with the same line."""
    record = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
              "shapes": None}  # fmt: skip
    bad = _broken(setup["export"], tmp_path / "p",
                  desc=_with_meta(**{SOURCE_METADATA_KEY: record}))  # fmt: skip
    rule = "metadata records a 'qwen3' source, config.json says model_type 'llama'"
    assert any(rule in f for f in inspect_artifact(bad)["findings"])
    with pytest.raises(InputError, match=rule):
        check_artifact_model(bad, None)
    with pytest.raises(InputError, match=rule):
        check_artifact_model(bad, setup["llama"])
    cfg = json.loads((setup["llama"] / "config.json").read_text())
    with pytest.raises(InputError, match=rule):
        check_merge_export(bad, cfg, source=setup["llama"])


def test_merge_refuses_an_unknown_recorded_target(setup, tmp_path):
    bad = _broken(setup["export"], tmp_path / "m",
                  desc=_with_meta(ascend_fa_target="tensorrt"))  # fmt: skip
    cfg = json.loads((setup["llama"] / "config.json").read_text())
    with pytest.raises(InputError, match="not a known target"):
        check_merge_export(bad, cfg, source=setup["llama"])


def test_inactive_reason_without_vllm():
    import importlib.util

    from ascend_fa.serving import inactive_reason

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    reason = inactive_reason()
    assert isinstance(reason, str) and "vLLM is not importable" in reason


# -- the plugin's after-loading check (no vLLM needed: plain parameters) -------


def _layer(*names: str) -> torch.nn.Module:
    from ascend_fa.serving.loaded import track_layer

    layer = torch.nn.Module()
    for n in names:
        p = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)

        def load(param, w, *args, **kwargs):
            param.data.copy_(w)

        p.weight_loader = load
        layer.register_parameter(n, p)
    track_layer(layer)
    return layer


def test_a_parameter_not_loaded_is_named():
    from ascend_fa.serving.loaded import check_loaded

    layer = _layer("weight", "bias")
    layer.weight.weight_loader(layer.weight, torch.ones(4, 2))
    with pytest.raises(ValueError) as e:
        check_loaded(layer, "model.layers.0.mlp.down_proj")
    assert str(e.value).startswith("model.layers.0.mlp.down_proj.bias: ")
    check_loaded(layer, "model.layers.0.mlp.down_proj", exempt=("bias",))


def test_a_fused_shard_not_loaded_is_named():
    from ascend_fa.serving.loaded import check_loaded

    layer = _layer("weight")
    for shard in ("q", "k"):
        layer.weight.weight_loader(layer.weight, torch.ones(4, 2), shard)
    with pytest.raises(ValueError, match=r"qkv_proj.weight \(shard 'v'\)"):
        check_loaded(layer, "model.layers.0.self_attn.qkv_proj", shards="qkv")
    layer.weight.weight_loader(layer.weight, torch.ones(4, 2), "v")
    check_loaded(layer, "model.layers.0.self_attn.qkv_proj", shards="qkv")


# -- eval's per-module attention metric on a rotated model --------------------


def test_attention_metric_in_the_float_basis_of_a_rotated_model():
    """The known case behind ``eval --artifact`` on the default demo artifact
    (cosine -0.008, rel-L1 1.6 with perplexity +12 %): the default W8A8 recipe
    rotates the residual stream (Hadamard ``Q``), so the artifact's attention
    outputs are ``o Q``. A rotated copy of a float model is the same function:
    its outputs, compared in the float basis, give cosine 1 and rel-L1 0 and the
    same perplexity; compared as written they are nearly orthogonal."""
    from ascend_fa.evaluation import evaluate, residual_basis
    from ascend_fa.transforms.residual import rotate_residual, rotation_matrix

    torch.manual_seed(0)
    model = tiny_llama().double().eval()
    rotated = copy.deepcopy(model)
    rot = rotate_residual(rotated, seed=3)
    q = residual_basis(model, rotated)
    assert q is not None
    assert torch.allclose(q, rotation_matrix(rot.size, 3), atol=1e-8)
    assert residual_basis(model, copy.deepcopy(model)) is None
    windows = [torch.randint(0, model.config.vocab_size, (24,)) for _ in range(2)]
    res = evaluate(model, windows, {"float": "float"}, models={"float": rotated})
    r = res["float"]
    assert r.min_cosine > 1 - 1e-9 and r.mean_rel_l1 < 1e-6
    assert abs(r.perplexity / r.perplexity_float - 1) < 1e-9
    # as written (no basis change) the same outputs are nearly orthogonal
    ids = windows[0][None]
    outs = []
    for m in (model, rotated):
        got: dict = {}
        attn = m.model.layers[0].self_attn
        h = attn.register_forward_hook(lambda _m, _a, o, g=got: g.update(o=o[0]))
        m(input_ids=ids, use_cache=False)
        h.remove()
        outs.append(got["o"].flatten())
    raw = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=0)
    assert abs(float(raw)) < 0.5
