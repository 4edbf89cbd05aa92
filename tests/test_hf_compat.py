"""The supported transformers range and the version shims (``ascend_fa.hf_compat``).

Runs under both environments CI tests: the default one (transformers 5) and the
transformers 4.57 one (``-m transformers4``, ``ci/unit.sh``).
"""

from __future__ import annotations

import json

import pytest

from ascend_fa import hf_compat
from ascend_fa.errors import UnsupportedError

pytestmark = pytest.mark.transformers4


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4.57.6", (4, 57, 6)),
        ("5.0.0rc1", (5, 0, 0)),
        ("5.1.dev0", (5, 1)),
        ("4.57.0+local", (4, 57, 0)),
    ],
)
def test_version_tuple(text, expected):
    assert hf_compat.version_tuple(text) == expected


@pytest.mark.parametrize(
    "version, supported",
    [
        ("4.56.2", False),
        ("4.57.0", True),
        ("4.57.6", True),
        ("5.0.0", True),
        ("5.25.0", True),
        ("6.0.0", False),
    ],
)
def test_support_status(version, supported):
    ok, line = hf_compat.support_status(version)
    assert ok is supported
    assert version in line and hf_compat.SUPPORTED in line and "\n" not in line
    assert hf_compat.support_status(None)[0] is (
        hf_compat.transformers_version() is not None
        and hf_compat.support_status(hf_compat.transformers_version())[0]
    )


def test_pyproject_declares_the_supported_range():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"transformers{hf_compat.SUPPORTED}"' in text


def test_installed_transformers_is_supported():
    import transformers

    assert hf_compat.transformers_version() == transformers.__version__
    assert hf_compat.support_status()[0], hf_compat.support_status()[1]
    major = int(transformers.__version__.split(".")[0])
    assert hf_compat.files_tag() == f"tf{major}"
    assert hf_compat.is_transformers5() is (major >= 5)


def test_require_transformers5_is_one_line(monkeypatch):
    monkeypatch.setattr(hf_compat, "transformers_version", lambda: "4.57.6")
    with pytest.raises(UnsupportedError) as info:
        hf_compat.require_transformers5("feature X")
    text = str(info.value)
    assert "\n" not in text
    assert "feature X needs transformers 5" in text and "4.57.6" in text
    monkeypatch.setattr(hf_compat, "transformers_version", lambda: "5.25.0")
    hf_compat.require_transformers5("feature X")


def test_attention_function_lookup():
    """What a llama attention module's forward calls for ``impl``, in either major."""
    from builders import tiny_llama
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attn = tiny_llama().model.layers[0].self_attn
    eager = __import__(type(attn).__module__, fromlist=["_"]).eager_attention_forward
    assert hf_compat.attention_function(attn, "eager") is eager
    assert hf_compat.attention_function(attn, "sdpa") is sdpa_attention_forward


def test_checkpoint_names_round_trip_on_a_gqa_model():
    """GQA models have no weight conversions in either major: names unchanged."""
    from builders import tiny_llama

    model = tiny_llama()
    sd = dict(model.state_dict())
    assert hf_compat.used_weight_conversions(model, list(sd)) == []
    assert list(hf_compat.revert_to_checkpoint_names(model, sd)) == list(sd)


def test_model_cache_entry_is_per_transformers_major(tmp_path, monkeypatch):
    from ascend_fa import model_cache

    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    here = model_cache.gguf_cache_dir(gguf)
    assert f"-{hf_compat.files_tag()}-" in here.name
    other = "4.57.6" if hf_compat.is_transformers5() else "5.25.0"
    monkeypatch.setattr(hf_compat, "transformers_version", lambda: other)
    assert model_cache.gguf_cache_dir(gguf) != here


def test_doctor_reports_the_transformers_version(capsys, monkeypatch):
    from ascend_fa.cli import main

    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["transformers"]
    assert info["version"] == hf_compat.transformers_version()
    assert info["supported"] is True and info["supported_range"] == ">=4.57,<6"
    assert main(["doctor"]) == 0
    assert f"transformers {info['version']}: supported" in capsys.readouterr().out

    import ascend_fa.doctor as doctor

    monkeypatch.setattr(doctor, "_version", lambda dist: "4.56.2")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "transformers 4.56.2: NOT supported (supported: >=4.57,<6)" in out
    assert "cannot run; missing a supported transformers" in out


@pytest.mark.skipif(
    hf_compat.is_transformers5(),
    reason="transformers 5 quantizes them (tests/test_linear_experts.py)",
)
def test_w8a8_dynamic_routed_experts_need_transformers5(tmp_path, capsys):
    """4.57 holds DeepSeek's routed experts as one module per expert: the CLI says,
    in one line and before writing anything, that this needs transformers 5."""
    from builders import save_tiny

    from ascend_fa.cli import main

    src = save_tiny(tmp_path / "ds", "deepseek_v3")
    out = tmp_path / "art"
    rc = main(
        ["-q", "calibrate", "--model", str(src), "--num-samples", "2"]
        + ["--max-length", "16", "--heldout", "1", "--no-report"]
        + ["--target", "vllm-ascend", "--output", str(out)]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "W8A8_DYNAMIC routed experts" in lines[0]
    assert "needs transformers 5" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "model_type, target",
    [
        ("llama", "mindie"),
        ("qwen2", "vllm-ascend"),
        ("qwen3", "vllm"),
        ("mistral", "vllm"),
        ("deepseek_v3", "mindie"),
    ],
)
def test_calibrate_inspect_eval_emulate(tmp_path, capsys, model_type, target):
    """The four verbs on every family in both majors: calibrate (W8A8 linears for
    mindie), inspect by the target's rules, eval and emulate of the artifact."""
    from builders import save_tiny

    from ascend_fa.cli import main

    # head_dim 16: 2 KV heads x 16 fill one int8 NZ column block (C0 = 32)
    extra = {} if model_type == "deepseek_v3" else {"head_dim": 16}
    src = save_tiny(tmp_path / "src", model_type, **extra)
    art = tmp_path / "art"
    common = ["--model", str(src)]
    # a Qwen2's C8 loads from vllm-ascend 0.25.1rc1 on (ascend_fa.artifact.releases)
    release = ["--consumer-version", "0.25.1rc1"] if target == "vllm-ascend" else []
    rc = main(
        ["-q", "calibrate", *common, "--num-samples", "4", "--max-length", "24"]
        + ["--batch-size", "2", "--heldout", "1", "--no-report", "--target", target]
        + ["--output", str(art), *release]
    )
    assert rc == 0, capsys.readouterr().err
    assert main(["-q", "inspect", str(art), "--target", target, *release]) == 0
    capsys.readouterr()
    assert (
        main(
            ["-q", "eval", *common, "--artifact", str(art), "--window", "16"]
            + ["--max-tokens", "32", "--json", str(tmp_path / "e.json")]
        )
        == 0
    )
    assert json.loads((tmp_path / "e.json").read_text())
    if model_type == "deepseek_v3":
        return  # the paged-cache emulation runs GQA decoders
    rc = main(
        ["-q", "emulate", *common, "--artifact", str(art), "--prompt", "abc"]
        + ["--max-new-tokens", "3", "--window", "16", "--max-eval-tokens", "32"]
        + ["--json", str(tmp_path / "m.json")]
    )
    assert rc == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "m.json").read_text())


def test_rotary_dim_reads_both_spellings_of_partial_rope():
    from types import SimpleNamespace as NS

    from ascend_fa.hf_compat import rotary_dim

    base = dict(num_attention_heads=4, hidden_size=64)
    assert rotary_dim(NS(**base, head_dim=16)) is None
    assert rotary_dim(NS(**base, head_dim=16, partial_rotary_factor=0.5)) == 8
    rope = {"partial_rotary_factor": 0.25, "rope_theta": 1e4}
    assert rotary_dim(NS(**base, head_dim=None, rope_parameters=rope)) == 4
    assert rotary_dim(NS(**base, head_dim=16, rotary_dim=8)) == 8
    assert rotary_dim(NS(**base, head_dim=16, rotary_dim=16)) is None
    assert rotary_dim(NS(**base, head_dim=16, partial_rotary_factor=1.0)) is None
