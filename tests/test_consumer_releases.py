"""``--consumer-version``: each release of the table loads what its source says.

``calibrate`` refuses, before the model loads, a release that cannot load (or would
load wrongly) the model's scheme, naming the first release that loads it (exit 2,
one line, nothing written); ``inspect`` reports it (exit 1) with the release, the
rule id and its citation; bad versions are one line, exit 2."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from builders import (  # noqa: E402
    quantize_linears,
    save_tiny,
    save_tiny_moe,
    tiny_deepseek,
)

from ascend_fa.artifact import (  # noqa: E402
    checkpoint_tensors,
    export_artifact,
    inspect_artifact,
)
from ascend_fa.artifact import releases as R  # noqa: E402
from ascend_fa.cli import main  # noqa: E402
from ascend_fa.errors import InputError, UnsupportedError  # noqa: E402

BF16 = torch.bfloat16
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b  # small helper",
    "Ascend NPUs run attention with int8 caches in fractal layouts.",
    "A lighthouse keeper climbed the stairs every evening at dusk.",
    "Numbers: 3.14159, 2.71828, 1.41421 and 0.57721 appear often.",
    "SELECT name, value FROM table WHERE id = 42 ORDER BY name;",
]
MINMAX = 'spec:\n  process:\n    - type: "fa3_quant"\n      method: minmax\n'
VA = "vllm-ascend"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save_tiny(root / "llama", "llama", dtype=BF16),
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
    argv = ["calibrate", "--model", str(model_dir), "--calib-data", str(calib)]
    argv += ["--recipe", str(recipe), "--num-samples", "4", "--max-length", "24"]
    argv += ["--batch-size", "2", "--heldout", "0", "--no-report", "--linear"]
    argv += ["none", "--output", str(out), "-q", *extra]
    return main(argv)


def one_line_error(capsys, rc):
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# -- the table --------------------------------------------------------------------
@pytest.mark.parametrize(
    "target,given,name",
    [
        (VA, "0.23.0.post1", "0.23.0.post1"),
        (VA, "0.25.1rc1", "0.25.1rc1"),
        (VA, "0.18.0", "0.18.0"),
        (VA, "0.13.0", "0.13.0"),
        (VA, "main", "main"),
        (VA, "MAIN", "main"),
        (VA, "v0.23.0.post1", "0.23.0.post1"),
        (VA, "v0.25.1rc1", "0.25.1rc1"),
        (VA, "0.23.0", "0.23.0.post1"),  # the 0.23 line: same C8 files
        (VA, "0.23.x", "0.23.0.post1"),
        (VA, "0.13", "0.13.0"),
        (VA, " 0.18.x ", "0.18.0"),
        (VA, None, "0.23.0.post1"),  # the newest stable release
        ("mindie", None, "3.0.0"),
        ("mindie", "v3.0.0", "3.0.0"),
    ],
)
def test_versions_normalise(target, given, name):
    assert R.resolve_release(target, given).name == name


@pytest.mark.parametrize(
    "target,given,message",
    [
        (VA, "0.20.2rc1", "is not a vllm-ascend release in the table"),
        (VA, "0.25.1", "is not a vllm-ascend release in the table"),
        (VA, "latest", "choose one of 0.13.0, 0.18.0, 0.23.0.post1, 0.25.1rc1"),
        (VA, "3.0.0", "that is a mindie release"),
        ("mindie", "0.23.0.post1", "that is a vllm-ascend release"),
        ("vllm", "0.23.0.post1", "--target vllm has no release table"),
    ],
)
def test_bad_versions(target, given, message):
    with pytest.raises(InputError, match=re.escape(message)) as e:
        R.resolve_release(target, given)
    assert "\n" not in str(e.value)


def test_vllm_has_no_release_and_defaults_are_stable():
    assert R.resolve_release("vllm", None) is None
    by_name = {(r.target, r.name): r for r in R.RELEASES}
    for target, name in R.DEFAULT_RELEASE.items():
        assert by_name[(target, name)].stable
    assert not by_name[(VA, "0.25.1rc1")].stable and not by_name[(VA, "main")].stable


def test_every_rule_is_cited_and_every_release_covered():
    names = {(r.target, r.name) for r in R.RELEASES}
    for rule in R.RULES:
        assert rule.citations, rule.id
        for c in rule.citations:
            assert c.repo in (R.VLLM_ASCEND, R.VLLM, R.MINDIE), rule.id
            assert re.fullmatch(r"[0-9a-f]{40}|v\d+\.\d+\.\d+\w*", c.ref), c
            assert c.path.endswith(".py"), c
        assert {(rule.target, n) for n in rule.releases} <= names, rule.id
    schemes = {VA: ("C8", "FAKQuant"), "mindie": ("FAQuant", "FAKQuant")}
    for r in R.RELEASES:
        for scheme in schemes[r.target]:  # every release says something of each
            assert R.rule_for(r, scheme, "SomeOtherForCausalLM") is not None, (
                r.name,
                scheme,
            )


# What each release does per scheme and architecture: None = loads, else the rule
# id that refuses it. Counter-examples sit beside each allow-list.
CASES = [
    ("0.13.0", "C8", "Qwen3ForCausalLM", "c8.unknown"),
    # the real loader on 0.13.0 (tests/test_vllm_ascend_loader.py): each failure
    # named as it raises
    ("0.13.0", "C8", "LlamaForCausalLM", "c8.embedding-prefix"),
    ("0.13.0", "C8", "MistralForCausalLM", "c8.embedding-prefix"),
    ("0.13.0", "C8", "Qwen2ForCausalLM", "c8.unknown"),
    ("0.13.0", "C8", "Gemma3ForCausalLM", "c8.unknown"),
    ("0.13.0", "C8", "Glm4MoeForCausalLM", "c8.unknown"),
    ("0.13.0", "C8", "MiniMaxM2ForCausalLM", "c8.unknown"),
    ("0.13.0", "C8", "MixtralForCausalLM", "c8.moe-experts-unmapped"),
    ("0.13.0", "C8", "Qwen2MoeForCausalLM", "c8.moe-experts-unmapped"),
    ("0.13.0", "C8", "Qwen3MoeForCausalLM", "c8.qwen3-moe-rename"),
    ("0.13.0", "C8", "Qwen3NextForCausalLM", "c8.qwen3-next-dropped"),
    ("0.18.0", "C8", "Qwen3NextForCausalLM", "c8.qwen3-next-dropped"),
    ("0.23.0.post1", "C8", "Qwen3NextForCausalLM", "c8.qwen3-next-dropped"),
    ("0.18.0", "C8", "Gemma3ForCausalLM", "c8.first-value"),
    ("0.18.0", "C8", "MiniMaxM2ForCausalLM", "c8.qwen3-only"),
    ("0.23.0.post1", "C8", "Gemma3ForCausalLM", "c8.unpatched-arch"),
    ("0.25.1rc1", "C8", "Qwen3NextForCausalLM", None),
    ("0.13.0", "FAKQuant", "DeepseekV3ForCausalLM", "fakquant.dropped"),
    ("0.18.0", "C8", "Qwen3ForCausalLM", None),
    ("0.18.0", "C8", "LlamaForCausalLM", "c8.first-value"),
    ("0.18.0", "C8", "MistralForCausalLM", "c8.first-value"),
    ("0.18.0", "C8", "Qwen2ForCausalLM", "c8.first-value"),
    ("0.18.0", "C8", "Glm4MoeForCausalLM", "c8.qwen3-only"),
    ("0.18.0", "FAKQuant", "DeepseekV3ForCausalLM", None),
    ("0.23.0.post1", "C8", "Qwen3ForCausalLM", None),
    ("0.23.0.post1", "C8", "Glm4MoeForCausalLM", None),
    ("0.23.0.post1", "C8", "MiniMaxM2ForCausalLM", None),
    ("0.23.0.post1", "C8", "LlamaForCausalLM", "c8.unpatched-arch"),
    ("0.23.0.post1", "C8", "MistralForCausalLM", "c8.unpatched-arch"),
    ("0.23.0.post1", "C8", "Qwen2ForCausalLM", "c8.unpatched-arch"),
    # the real loader (tests/test_vllm_ascend_loader.py): scales dropped silently
    ("0.23.0.post1", "C8", "Qwen3MoeForCausalLM", "c8.moe-scales-dropped"),
    ("0.18.0", "C8", "MixtralForCausalLM", "c8.first-value"),
    ("0.18.0", "C8", "Qwen3MoeForCausalLM", "c8.qwen3-moe-scalar"),
    ("0.18.0", "C8", "Qwen2MoeForCausalLM", "c8.qwen2-moe-rename"),
    ("0.23.0.post1", "C8", "Qwen2MoeForCausalLM", "c8.qwen2-moe-rename"),
    ("main", "C8", "Qwen2MoeForCausalLM", "c8.qwen2-moe-qkv-module"),
    ("0.25.1rc1", "C8", "Qwen2MoeForCausalLM", "c8.qwen2-moe-qkv-module"),
    ("0.25.1rc1", "C8", "Gemma3ForCausalLM", "c8.gemma3-qkv-module"),
    ("main", "C8", "Gemma3ForCausalLM", "c8.gemma3-qkv-module"),
    ("0.23.0.post1", "FAKQuant", "DeepseekV3ForCausalLM", None),
    ("0.25.1rc1", "C8", "LlamaForCausalLM", None),
    ("0.25.1rc1", "C8", "Qwen2ForCausalLM", None),
    ("0.25.1rc1", "C8", "Qwen3ForCausalLM", None),
    ("0.25.1rc1", "FAKQuant", "DeepseekV3ForCausalLM", None),
    ("main", "C8", "MistralForCausalLM", None),
    ("main", "FAKQuant", "DeepseekV3ForCausalLM", None),
    # Qwen3.5's wrappers (the real loader, tests/test_vllm_ascend_loader.py)
    ("0.13.0", "C8", "Qwen3_5MoeForConditionalGeneration", "arch.qwen3-5-unknown"),
    ("0.18.0", "C8", "Qwen3_5MoeForConditionalGeneration", "c8.qwen3-5-dropped"),
    ("0.23.0.post1", "C8", "Qwen3_5ForConditionalGeneration", "c8.qwen3-5-dropped"),
    ("main", "C8", "Qwen3_5MoeForConditionalGeneration", None),
    # no quantization mapping at any release
    ("0.23.0.post1", "linears", "GptOssForCausalLM", "quant.no-mapping"),
    ("main", "C8", "Llama4ForCausalLM", "quant.no-mapping"),
    # Gemma 4: no mapping up to 0.23; no plan of ours for main's
    ("0.13.0", "linears", "Gemma4ForCausalLM", "quant.gemma4-no-plan"),
    ("0.23.0.post1", "C8", "Gemma4ForCausalLM", "quant.gemma4-no-plan"),
    ("main", "C8", "Gemma4ForCausalLM", "quant.gemma4-no-plan"),
    ("0.18.0", "linears", "Ernie4_5_MoeForCausalLM", "quant.ernie-no-mapping"),
    ("main", "C8", "Ernie4_5_MoeForCausalLM", "quant.ernie-no-mapping"),
]


# The one-line refusal names what the real loader raised on that release (the slow
# tests/test_vllm_ascend_loader.py checks these against the loader itself; the
# releases that load them are the counter-examples of CASES).
REAL_FAILURES = [
    ("0.13.0", "LlamaForCausalLM", "KeyError '.weight'"),
    ("0.13.0", "MistralForCausalLM", "KeyError '.weight'"),
    (
        "0.13.0",
        "MixtralForCausalLM",
        "KeyError 'model.layers.0.block_sparse_moe.experts.weight'",
    ),
    ("0.13.0", "Qwen2MoeForCausalLM", "'model.layers.0.mlp.experts.weight'"),
    ("0.13.0", "Qwen3MoeForCausalLM", "KeyError '<attn>.qkqkv_proj.kv_cache_offset'"),
    ("0.13.0", "Gemma3ForCausalLM", "KeyError '<attn>.qkv_proj.kv_cache_offset'"),
    ("0.13.0", "Qwen3NextForCausalLM", "silently ignores C8"),
    ("0.18.0", "MiniMaxM2ForCausalLM", "KeyError '<attn>.qkv_proj.kv_cache_offset'"),
    ("0.18.0", "Glm4MoeForCausalLM", "KeyError '<attn>.qkv_proj.kv_cache_offset'"),
    ("0.18.0", "Gemma3ForCausalLM", "silently ignores C8"),
    ("0.18.0", "Qwen3NextForCausalLM", "silently ignores C8"),
    ("0.23.0.post1", "Gemma3ForCausalLM", "KeyError '<attn>.qkv_proj.kv_cache_offset'"),
    ("0.23.0.post1", "Qwen3NextForCausalLM", "silently ignores C8"),
]


@pytest.mark.parametrize("version,arch,failure", REAL_FAILURES)
def test_refusal_names_the_real_failure(version, arch, failure):
    release = R.resolve_release(VA, version)
    (line,) = R.release_findings(VA, release, "C8", arch)
    assert failure in line and "the real loader" in line, line


@pytest.mark.parametrize("version,scheme,arch,refused_by", CASES)
def test_release_rules(version, scheme, arch, refused_by):
    release = R.resolve_release(VA, version)
    rule = R.rule_for(release, scheme, arch)
    assert rule is not None
    assert (None if rule.loads else rule.id) == refused_by
    found = R.release_findings(VA, release, scheme, arch)
    if refused_by is None:
        assert found == []
    else:
        (line,) = found
        assert line.startswith(f"vllm-ascend {version} ")
        assert f"[{refused_by}]" in line and rule.citations[0].path in line


@pytest.mark.parametrize(
    "scheme,arch,first",
    [
        ("C8", "LlamaForCausalLM", "0.25.1rc1"),
        ("C8", "Qwen2ForCausalLM", "0.25.1rc1"),
        ("C8", "Qwen3ForCausalLM", "0.18.0"),
        ("C8", "Glm4MoeForCausalLM", "0.23.0.post1"),
        ("FAKQuant", "DeepseekV3ForCausalLM", "0.18.0"),
    ],
)
def test_first_release_that_loads(scheme, arch, first):
    assert R.first_loading(VA, scheme, arch).name == first


def test_mindie_loads_every_scheme_we_write():
    mindie = R.resolve_release("mindie", None)
    for scheme in ("FAQuant", "FAKQuant"):
        assert R.release_findings("mindie", mindie, scheme, "LlamaForCausalLM") == []


def test_architecture_from_config():
    assert R.architecture({"architectures": ["Qwen3ForCausalLM"]}) == (
        "Qwen3ForCausalLM"
    )
    assert R.architecture({"model_type": "mistral"}) == "MistralForCausalLM"
    assert R.architecture({"model_type": "gpt2"}) is None
    assert R.architecture(None) is None


@pytest.mark.parametrize(
    "config,version,needle",
    [
        ({"model_type": "qwen2"}, "0.23.0.post1", "first release that loads it"),
        ({"model_type": "mistral"}, "0.18.0", "loaded_weight[0]"),
        ({"model_type": "qwen3"}, "0.13.0", "0.18.0 is the first release"),
        ({"model_type": "deepseek_v3"}, "0.13.0", "silently ignores FAKQuant"),
    ],
)
def test_check_release_refuses_from_the_config(config, version, needle):
    with pytest.raises(UnsupportedError, match=re.escape(needle)):
        R.check_release(VA, version, config=config)


def test_check_release_lets_loadable_and_unknown_models_through():
    assert R.check_release(VA, None, config={"model_type": "qwen3"}) == VA
    assert R.check_release(VA, "main", config={"model_type": "llama"}) == VA
    # not a model type ascend-fa calibrates: the adapter registry says so later
    assert R.check_release(VA, None, config={"model_type": "gpt2"}) == VA
    assert R.check_release("vllm", None, config={"model_type": "llama"}) == "vllm"
    assert R.check_release(None, None, config={"model_type": "llama"}) == "mindie"


def test_demo_gguf_is_read_from_its_header():
    """The default model (SmolLM2, a Llama GGUF) is checked from the GGUF header,
    before anything loads."""
    pytest.importorskip("gguf")
    from ascend_fa.models import default_model_location

    try:
        where, name = default_model_location()
    except Exception as exc:  # noqa: BLE001 - demo model not installed
        pytest.skip(str(exc))
    assert R._gguf_config(where, name) == R.DEFAULT_MODEL_CONFIG
    with pytest.raises(UnsupportedError, match="--consumer-version 0.25.1rc1"):
        R.check_release(VA, None)
    assert R.check_release(VA, "0.25.1rc1") == VA


# -- calibrate and inspect on tiny real models -------------------------------------
@pytest.fixture(scope="module")
def llama_c8(models, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("c8") / "llama"
    rc = run_calibrate(
        models["llama"], out, data, "--target", VA, "--consumer-version", "0.25.1rc1"
    )
    assert rc == 0
    return out


def test_calibrate_refuses_llama_c8_on_0_23_before_loading(
    models, data, tmp_path, capsys, monkeypatch
):
    import ascend_fa.models

    calls = []
    monkeypatch.setattr(ascend_fa.models, "load_model", lambda *a, **k: calls.append(a))
    out = tmp_path / "o"
    rc = run_calibrate(
        models["llama"], out, data, "--target", VA, "--consumer-version", "0.23.0.post1"
    )
    line = one_line_error(capsys, rc)
    assert "0.25.1rc1 is the first release that loads it" in line
    assert "cannot load C8 for LlamaForCausalLM" in line
    assert "KeyError" in line and "patch_gqa_c8.py" in line
    # the default is the newest stable release: the same refusal
    line = one_line_error(
        capsys, run_calibrate(models["llama"], out, data, "--target", VA)
    )
    assert "--consumer-version 0.23.0.post1:" in line
    assert calls == [] and not out.exists()


@pytest.mark.parametrize(
    "version,rc",
    [("0.25.1rc1", 0), ("main", 0), ("0.23.0.post1", 1), ("0.18.0", 1), ("0.13.0", 1)],
)
def test_inspect_llama_c8_per_release(llama_c8, capsys, version, rc):
    assert main(["inspect", str(llama_c8), "--consumer-version", version]) == rc
    out = capsys.readouterr().out
    if rc:
        (finding,) = [f for f in out.splitlines() if f"- vllm-ascend {version}" in f]
        assert "[c8." in finding and "vllm-project/" in finding
        assert "--consumer-version 0.25.1rc1" in finding
    r = inspect_artifact(llama_c8, consumer_version=version)
    assert r["consumer_version"] == version
    assert r["summary"]["consumer_version"] == version


def test_qwen3_c8_on_the_default_release(models, data, tmp_path, capsys):
    out = tmp_path / "qwen3"
    assert run_calibrate(models["qwen3"], out, data, "--target", VA) == 0
    assert main(["inspect", str(out)]) == 0  # recorded target, default release
    assert main(["inspect", str(out), "--consumer-version", "0.23.0.post1"]) == 0
    assert main(["inspect", str(out), "--consumer-version", "0.18.0"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--consumer-version", "0.13.0"]) == 1
    assert "[c8.unknown]" in capsys.readouterr().out
    line = one_line_error(
        capsys,
        run_calibrate(
            models["qwen3"],
            tmp_path / "o",
            data,
            "--target",
            VA,
            "--consumer-version",
            "0.13",
        ),
    )
    assert "0.18.0 is the first release that loads it" in line


def test_mla_fakquant_refused_on_0_13(models, data, tmp_path, capsys):
    out = tmp_path / "ds"
    line = one_line_error(
        capsys,
        run_calibrate(
            models["deepseek_v3"],
            out,
            data,
            "--target",
            VA,
            "--consumer-version",
            "0.13.0",
        ),
    )
    assert "silently ignores FAKQuant for DeepseekV3ForCausalLM" in line
    assert "latent cache stays bf16" in line and "0.18.0 is the first" in line
    assert not out.exists()


@pytest.fixture(scope="module")
def mla_artifact(tmp_path_factory):
    """A vllm-ascend FAKQuant artifact: W8A8_DYNAMIC MLA linears, one latent head."""
    model = tiny_deepseek()
    quantize_linears(
        model, "W8A8_DYNAMIC", skip=("lm_head", "kv_b_proj", "gate", "o_proj")
    )
    g = torch.Generator().manual_seed(0)
    heads = {"fa_q": 4, "fa_k": 1, "fa_v": 1}
    scales = {
        f"model.layers.{i}.self_attn": {
            b: (
                torch.rand(h, generator=g) * 0.1 + 1e-3,
                torch.zeros(h, dtype=torch.int8),
            )
            for b, h in heads.items()
        }
        for i in range(2)
    }
    ckpt = checkpoint_tensors(model, BF16, tied_copies=True)
    return export_artifact(
        tmp_path_factory.mktemp("mla") / "ds",
        state_dict=ckpt.tensors,
        tensor_types=ckpt.types,
        scales=scales,
        fa_quant_type="FAKQuant",
        target=VA,
        config=model.config.to_dict(),
        dtype=BF16,
    )


@pytest.mark.parametrize(
    "version,valid",
    [("0.13.0", False), ("0.18.0", True), ("0.23.0.post1", True), ("main", True)],
)
def test_inspect_mla_fakquant_per_release(mla_artifact, version, valid):
    r = inspect_artifact(mla_artifact, consumer_version=version)
    assert r["valid"] is valid, r["findings"]
    if not valid:
        (f,) = r["findings"]
        assert "[fakquant.dropped]" in f and "patch_deepseekv3.py@6281c1207a" in f


@pytest.mark.parametrize(
    "args,message",
    [
        (("--target", VA, "--consumer-version", "0.99"), "'0.99' is not a vllm-ascend"),
        (
            ("--target", "mindie", "--consumer-version", "0.23.0.post1"),
            "a vllm-ascend release",
        ),
        (("--target", "vllm", "--consumer-version", "main"), "has no release table"),
    ],
)
def test_calibrate_bad_versions(models, data, tmp_path, capsys, args, message):
    line = one_line_error(
        capsys, run_calibrate(models["llama"], tmp_path / "o", data, *args)
    )
    assert message in line
    assert not (tmp_path / "o").exists()


def test_inspect_bad_versions(llama_c8, tmp_path, capsys):
    line = one_line_error(
        capsys, main(["inspect", str(llama_c8), "--consumer-version", "0.24"])
    )
    assert "'0.24' is not a vllm-ascend release" in line
    line = one_line_error(
        capsys,
        main(
            ["inspect", str(llama_c8), "--target", "vllm", "--consumer-version", "main"]
        ),
    )
    assert "has no release table" in line
    bare = tmp_path / "bare"  # records no target
    bare.mkdir()
    line = one_line_error(
        capsys, main(["inspect", str(bare), "--consumer-version", "main"])
    )
    assert "needs a target" in line


def test_one_commit_per_consumer_across_the_package():
    """The commit the per-consumer rules cite is the table's main / 3.0.0 row."""
    import inspect as pyinspect

    from ascend_fa.backends import npu_capabilities

    from ascend_fa.artifact import consumers, targets

    main_row = R.resolve_release(VA, "main").commit
    assert main_row == npu_capabilities.VLLM_ASCEND_COMMIT
    mindie = R.resolve_release("mindie", "3.0.0").commit
    for module in (consumers, targets):
        text = pyinspect.getsource(module)
        assert mindie[:8] in text and main_row[:8] in text, module.__name__


# -- quantized routed experts of Mixtral / Qwen2-MoE --------------------------------
@pytest.mark.parametrize(
    "model_type,key",
    [
        ("mixtral", "model.layers.0.block_sparse_moe.experts.weight"),
        ("qwen2_moe", "model.layers.0.mlp.experts.weight"),
    ],
)
def test_quantized_experts_are_refused_on_every_vllm_ascend_release(
    model_type, key, data, tmp_path, capsys
):
    """vllm-ascend maps no ``experts`` for these models (the real loader raises
    KeyError building the model): calibrate refuses before any work, one line,
    nothing written; --linear none is let through to the C8 rules."""
    src = save_tiny_moe(tmp_path / "src", model_type)
    out = tmp_path / "out"
    capsys.readouterr()
    for version in ("0.13.0", "0.18.0", "0.23.0.post1", "0.25.1rc1", "main"):
        argv = ["--target", VA, "--consumer-version", version]
        rc = run_calibrate(src, out, data, *argv, "--linear", "w8a8_dynamic")
        line = one_line_error(capsys, rc)
        assert "[linears.experts-unmapped]" in line and f"KeyError '{key}'" in line
        assert f"vllm-ascend {version} cannot load quantized routed experts" in line
        assert "modelslim_config.py" in line and not out.exists()
    argv = ["--target", VA, "--consumer-version", "main", "--linear", "none"]
    rc = run_calibrate(src, out, data, *argv)  # mixtral C8 loads; qwen2_moe's not
    assert rc == (0 if model_type == "mixtral" else 2)
    assert "experts-unmapped" not in capsys.readouterr().err


def test_inspect_reports_quantized_experts(data, tmp_path, capsys, monkeypatch):
    """An artifact whose description marks Mixtral's experts quantized (written
    with the release check lifted) is invalid for every vllm-ascend release."""
    from ascend_fa.calibration import plan as plan_module

    src = save_tiny_moe(tmp_path / "src", "mixtral")
    out = tmp_path / "art"
    checks = list(plan_module.PREFLIGHT_CHECKS)
    checks.remove(plan_module.check_consumer_release)
    monkeypatch.setattr(plan_module, "PREFLIGHT_CHECKS", checks)
    argv = ["--target", VA, "--consumer-version", "main", "--linear", "w8a8_dynamic"]
    assert run_calibrate(src, out, data, *argv) == 0
    capsys.readouterr()
    for version in ("0.18.0", "main"):
        rep = inspect_artifact(out, target=VA, consumer_version=version)
        lines = [f for f in rep["findings"] if "[linears.experts-unmapped]" in f]
        assert not rep["valid"] and len(lines) == 1, rep["findings"]
        assert "block_sparse_moe.experts.weight" in lines[0]


# -- config.json as transformers 5 saves it ----------------------------------------
# The real loader (tests/test_vllm_ascend_loader.py, cases *_tf5): vLLM 0.13 / 0.18
# parse Gemma 3's per-layer-type rope_parameters with transformers 4.57 and raise
# ValidationError before any weight loads; 0.23.0.post1 (transformers 5) parses it.
# A flat rope_parameters loads everywhere it parses: the artifact keeps the
# top-level rope_theta the writer adds (0.18.0 builds theta 500000, as stated).
@pytest.fixture(scope="module")
def tf5_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf5")
    gemma = save_tiny(
        root / "gemma3", "gemma3_text", dtype=BF16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )  # fmt: skip
    qwen3 = save_tiny(
        root / "qwen3", "qwen3", dtype=BF16,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )  # fmt: skip
    nested = json.loads((gemma / "config.json").read_text())["rope_parameters"]
    assert set(nested) == {"full_attention", "sliding_attention"}
    return {"gemma3": gemma, "qwen3": qwen3}


def test_per_layer_type_rope_is_read_from_the_config():
    from ascend_fa.artifact.release_loader import CONFIG_RULES, per_layer_type_rope

    for rule, _ in CONFIG_RULES:  # cited as the release table's rules are
        assert rule.citations and set(rule.releases) <= {"0.13.0", "0.18.0"}
        for c in rule.citations:
            assert c.repo == R.VLLM and c.path.endswith(".py"), c
            assert re.fullmatch(r"v\d+\.\d+\.\d+", c.ref) and "L" in c.where, c

    nested = {"rope_parameters": {"full_attention": {"rope_type": "default"}}}
    assert per_layer_type_rope(nested)
    # transformers 4 takes a rope_scaling in its place; flat and published layouts
    assert not per_layer_type_rope({**nested, "rope_scaling": {"factor": 8.0}})
    assert not per_layer_type_rope({"rope_parameters": {"rope_type": "default"}})
    assert not per_layer_type_rope({"rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert not per_layer_type_rope(None)


@pytest.mark.parametrize("version", ["0.18.0", "0.13.0"])
def test_calibrate_refuses_per_layer_type_rope_before_loading(
    tf5_sources, data, tmp_path, capsys, monkeypatch, version
):
    import ascend_fa.models

    calls = []
    monkeypatch.setattr(ascend_fa.models, "load_model", lambda *a, **k: calls.append(a))
    out = tmp_path / "o"
    rc = run_calibrate(
        tf5_sources["gemma3"], out, data, "--target", VA, "--consumer-version", version
    )
    line = one_line_error(capsys, rc)
    assert f"vllm-ascend {version} cannot parse the config.json of Gemma3" in line
    assert "[config.per-layer-type-rope]" in line
    assert "ValidationError" in line and "'rope_type'" in line
    assert "--consumer-version 0.23.0.post1" in line
    assert "vllm/transformers_utils/config.py@v" in line
    assert calls == [] and not out.exists()


def test_flat_rope_parameters_load_where_the_release_parses_them(
    tf5_sources, data, tmp_path
):
    for version in ("0.18.0", "0.23.0.post1"):
        out = tmp_path / version
        rc = run_calibrate(
            tf5_sources["qwen3"], out, data, "--target", VA, "--consumer-version",
            version,
        )  # fmt: skip
        assert rc == 0
        config = json.loads((out / "config.json").read_text())
        assert config["rope_parameters"]["rope_theta"] == config["rope_theta"]
        assert main(["inspect", str(out), "--consumer-version", version]) == 0


@pytest.fixture(scope="module")
def gemma3_tf5_c8(tf5_sources, data, tmp_path_factory):
    """Gemma 3 C8 from a transformers-5 source, the release pre-flight lifted
    (the artifact a refusal prevents)."""
    from ascend_fa.calibration import plan as plan_module

    checks = plan_module.PREFLIGHT_CHECKS
    kept = list(checks)
    checks[checks.index(plan_module.check_consumer_release)] = lambda plan: None
    out = tmp_path_factory.mktemp("g3") / "gemma3"
    try:
        rc = run_calibrate(
            tf5_sources["gemma3"], out, data, "--target", VA, "--consumer-version",
            "main",
        )  # fmt: skip
    finally:
        checks[:] = kept
    assert rc == 0
    return out


@pytest.mark.parametrize(
    "version,rule",
    [
        ("0.18.0", "config.per-layer-type-rope"),
        ("0.13.0", "config.per-layer-type-rope"),
        # transformers 5 parses it; the C8 rule then decides (KeyError)
        ("0.23.0.post1", "c8.unpatched-arch"),
    ],
)
def test_inspect_per_layer_type_rope(gemma3_tf5_c8, capsys, version, rule):
    rc = main(["inspect", str(gemma3_tf5_c8), "--consumer-version", version])
    out = capsys.readouterr().out
    assert rc == 1
    (finding,) = [f for f in out.splitlines() if f"- vllm-ascend {version}" in f]
    assert f"[{rule}]" in finding
    assert ("ValidationError" in finding) == rule.startswith("config.")


def test_flat_rope_parameters_without_top_level_theta_per_release(
    tf5_sources, data, tmp_path, capsys
):
    """An artifact whose config.json lacks the top-level rope_theta (ours always
    has it; another tool's may not): the real loader built theta 10000 on 0.18.0
    (silently) and the stated 500000 on 0.23.0.post1."""
    out = tmp_path / "qwen3"
    assert run_calibrate(tf5_sources["qwen3"], out, data, "--target", VA) == 0
    path = out / "config.json"
    config = json.loads(path.read_text())
    del config["rope_theta"]
    path.write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["inspect", str(out), "--consumer-version", "0.18.0"]) == 1
    report = capsys.readouterr().out
    assert "rope_theta missing at the top level" in report and "10000" in report
    assert main(["inspect", str(out), "--consumer-version", "0.23.0.post1"]) == 0
    capsys.readouterr()
    # MindIE reads it with transformers 4 as well: the finding stays for mindie
    assert main(["inspect", str(out), "--target", "mindie"]) == 1
    assert "rope_theta missing at the top level" in capsys.readouterr().out
