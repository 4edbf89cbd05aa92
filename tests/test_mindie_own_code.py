"""MindIE-LLM's own code judges ``--target mindie`` artifacts (slow suite).

``MINDIE_LLM_SRC`` names a MindIE-LLM source tree at :data:`COMMIT` (v3.0.0; CI
cannot fetch it, so the module skips in one line without it). ``ci/mindie_env.sh``
builds the Python it runs under (transformers 4.57 and numba, which MindIE's code
imports). ``tests/mindie_own_driver.py`` runs MindIE's own model construction on
each artifact: ``get_model`` (its router reading config.json and the description),
``Weights``, and the model class's ``__init__`` (``FlashLlamaForCausalLM``,
``FlashQwen2ForCausalLM``, ``FlashDeepseekv2ForCausalLM``, ``FlashQwen2moeForCausalLM``,
``FlashGlm4moeForCausalLM``, ``FlashMixtralForCausalLM``), which loads every weight
through ``load_column_multi``, ``TensorParallel*Linear.load``, ``FA3.load`` /
``load_mla`` and ``KvCache.load``, with the stand-ins of ``tests/mindie_stub`` for
torch_npu, acl and the ATB libraries (each recording what it is asked and refusing
what it does not know).

The cases are every artifact ``calibrate --target mindie`` writes for each family
MindIE has an atb model for (the default linears, and Qwen3-MoE's ``--linear
w8a8_dynamic``), and the counter-examples: DeepSeek's shared experts
W8A8_DYNAMIC, a Qwen MoE artifact without ``quantize``, FA scales injected into a
MoE artifact, all-dynamic Qwen MoE linears without ``attn_quantize`` and a GLM-4-MoE
artifact without q/k/v biases (the two artifacts of the issue), a llama artifact
under ``model_type`` mistral (what ``calibrate`` refuses: MindIE's mistral router
reads config.json only), and the four families MindIE has no model for.

MindIE's verdict per case (``loads``: built, every quantized tensor held by the
module as MindIE transforms it, every ``fa_*`` tensor read; ``silent``: built, but
not so; ``error``: its exception) must equal ours: ``inspect --target mindie``
valid exactly when it loads; the loader model (``tests/mindie_loader.py``) loads
with every FA scale read exactly when it loads, and fails on the same missing
tensor where MindIE fails on one; ``calibrate`` wrote the default artifacts (exit
0) and MindIE loads each. The run's table must be the one in
``docs/reference/mindie.md`` (``ASCEND_FA_UPDATE_DOCS=1`` rewrites it there).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ascend_fa import settings

pytestmark = pytest.mark.slow
if not os.environ.get("MINDIE_LLM_SRC"):
    pytest.skip(
        "MINDIE_LLM_SRC not set (a MindIE-LLM source tree at v3.0.0)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "mindie_own_driver.py"
ENV_SCRIPT = ROOT / "ci" / "mindie_env.sh"
DOC = ROOT / "docs" / "reference" / "mindie.md"
#: The MindIE-LLM commit judged (tag v3.0.0).
COMMIT = "8b4871ad31f592aa863f6255760e4934484d78e4"
#: sha256 of the cited files at COMMIT, concatenated in this order: a source tree
#: at another commit is refused in one line.
FINGERPRINT_FILES = (
    "models/base/router.py",
    "utils/weights.py",
    "models/qwen2/modeling_qwen2.py",
    "models/qwen2_moe/modeling_qwen2_moe.py",
    "models/glm4_moe/modeling_glm4_moe.py",
)
FINGERPRINT = "7c3c370d9a792c7a5ca159e4ce08b828436a780bb5ee67f0c91df03b4fb59e0d"
RUN = ["--num-samples", "4", "--max-length", "32", "--batch-size", "2"]
RUN += ["--heldout", "1", "--no-report", "-q"]
#: family -> vocabulary of its tiny source: MindIE's config classes check token
#: ids against it (``models/base/config.py`` L196-197 sets ``top_k`` 1000 when
#: config.json has none; Qwen3's reasoning token ids are 151667 / 151668,
#: ``models/qwen3/config_qwen3.py``), so the vocabulary is Qwen3's own for Qwen3.
VOCAB = {"qwen3": 151936, "qwen3_moe": 151936}
DENSE = ("llama", "qwen2", "qwen3", "deepseek_v3", "kimi_k2")
MOE = ("qwen2_moe", "qwen3_moe", "glm4_moe", "mixtral")
NO_MODEL = ("minimax_m2", "qwen3_next", "gemma3_text", "glm_moe_dsa")
#: case -> MindIE's verdict (what this commit does; the run must agree)
EXPECTED = {
    **{f: "loads" for f in (*DENSE, *MOE)},
    "qwen3_moe_dynamic": "loads",
    "deepseek_v3_dynamic_shared": "error",
    "qwen3_moe_no_quantize": "error",
    "qwen3_moe_fa": "silent",
    "glm4_moe_fa": "silent",
    "qwen3_moe_dynamic_no_attn_quantize": "error",
    "glm4_moe_no_bias": "error",
    "mistral_refused": "error",
    **{f"{t}_no_model": "error" for t in NO_MODEL},
}


def _source_tree() -> Path:
    src = os.environ.get("MINDIE_LLM_SRC")
    if not src:
        pytest.skip("MINDIE_LLM_SRC not set (a MindIE-LLM source tree at v3.0.0)")
    root = Path(src)
    atb = root / "examples" / "atb_models" / "atb_llm"
    if not atb.is_dir():
        pytest.fail(f"MINDIE_LLM_SRC={src}: no examples/atb_models/atb_llm there")
    h = hashlib.sha256()
    for f in FINGERPRINT_FILES:
        h.update((atb / f).read_bytes())
    if h.hexdigest() != FINGERPRINT:
        pytest.fail(f"MINDIE_LLM_SRC={src} is not MindIE-LLM @{COMMIT[:8]}")
    return root


def _env_python() -> Path:
    proc = subprocess.run(
        ["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        pytest.fail(f"ci/mindie_env.sh failed (exit {proc.returncode}): {tail}")
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"


def _calibrate(src: Path, out: Path, *extra: str) -> int:
    from ascend_fa.cli import main

    return main(["calibrate", "--model", str(src), *RUN, "--output", str(out), *extra])


def _edit(art: Path, out: Path, *, cfg=None, desc=None, tensors=None) -> Path:
    """A copy of ``art`` with config.json, the description and the tensors each
    changed in place by the given function."""
    from builders import artifact_tensors
    from safetensors.torch import save_file

    from ascend_fa.artifact import DESCRIPTION_FILE

    shutil.copytree(art, out)
    for fn, name in ((cfg, "config.json"), (desc, DESCRIPTION_FILE)):
        if fn is not None:
            data = json.loads((out / name).read_text())
            fn(data)
            (out / name).write_text(json.dumps(data, indent=2))
    if tensors is not None:
        ts = artifact_tensors(out)
        for f in out.glob("*.safetensors*"):
            f.unlink()
        fn_desc = tensors(ts)
        save_file(ts, str(out / "quant_model_weights.safetensors"))
        if fn_desc is not None:
            data = json.loads((out / DESCRIPTION_FILE).read_text())
            fn_desc(data)
            (out / DESCRIPTION_FILE).write_text(json.dumps(data, indent=2))
    return out


def _dynamic_shared(ts: dict):
    gone = ("deq_scale", "quant_bias", "input_scale", "input_offset")
    for n in [n for n in ts if ".shared_experts." in n and n.endswith(gone)]:
        del ts[n]

    def desc(d):
        for n in list(d):
            if ".shared_experts." in n and n.endswith(gone):
                del d[n]
            elif ".shared_experts." in n and d[n] == "W8A8":
                d[n] = "W8A8_DYNAMIC"

    return desc


def _inject_fa(ts: dict):
    """FAQuant scales on every attention (per query / KV head), as a GQA artifact
    carries them."""
    attns = sorted({n.rsplit(".", 2)[0] for n in ts if n.endswith("q_proj.weight")})
    for a in attns:
        for b, heads in (("q", 4), ("k", 2), ("v", 2)):
            ts[f"{a}.fa_{b}.scale"] = torch.full((heads, 1), 0.01)
            ts[f"{a}.fa_{b}.offset"] = torch.zeros(heads, 1, dtype=torch.int8)

    def desc(d):
        d["fa_quant_type"] = "FAQuant"
        for a in attns:
            d[f"{a}.quant_type"] = "INT8"
            for b in "qkv":
                d[f"{a}.fa_{b}.scale"] = d[f"{a}.fa_{b}.offset"] = "FAQuant"

    return desc


def _no_bias(ts: dict):
    for n in [n for n in ts if n.endswith("_proj.bias") and ".self_attn." in n]:
        del ts[n]

    def desc(d):
        for n in [n for n in d if n.endswith("_proj.bias") and ".self_attn." in n]:
            del d[n]

    return desc


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Path]:
    """case -> artifact directory (see the module doc)."""
    _source_tree()
    from builders import save_kimi_k2, save_tiny, save_tiny_moe

    root = tmp_path_factory.mktemp("mindie_own")
    out: dict[str, Path] = {}
    for fam in (*DENSE, *MOE):
        src = root / f"{fam}-src"
        vocab = VOCAB.get(fam, 1024)
        if fam in MOE:
            save_tiny_moe(src, fam, vocab_size=vocab)
        elif fam == "kimi_k2":  # Kimi-K2's config.json over DeepSeek-V3
            save_kimi_k2(src, vocab_size=vocab)
        else:
            save_tiny(src, fam, vocab_size=vocab)
        if fam == "deepseek_v3":
            # the released config.json's keys transformers' config drops, which
            # MindIE's DeepSeek model reads (flash_causal_deepseekv2.py topk_method)
            c = json.loads((src / "config.json").read_text())
            c.update(topk_method="noaux_tc", scoring_func="sigmoid")
            (src / "config.json").write_text(json.dumps(c, indent=2))
        out[fam] = root / fam
        assert _calibrate(src, out[fam]) == 0, fam
    dyn = root / "qwen3_moe_dynamic"
    assert _calibrate(root / "qwen3_moe-src", dyn, "--linear", "w8a8_dynamic") == 0
    out["qwen3_moe_dynamic"] = dyn
    e = root / "edited"
    e.mkdir()
    out["deepseek_v3_dynamic_shared"] = _edit(
        out["deepseek_v3"], e / "ds_shared", tensors=_dynamic_shared
    )
    out["qwen3_moe_no_quantize"] = _edit(
        out["qwen3_moe"], e / "noq", cfg=lambda c: c.pop("quantize")
    )
    out["qwen3_moe_fa"] = _edit(out["qwen3_moe"], e / "qfa", tensors=_inject_fa)
    out["glm4_moe_fa"] = _edit(out["glm4_moe"], e / "gfa", tensors=_inject_fa)
    out["qwen3_moe_dynamic_no_attn_quantize"] = _edit(
        dyn, e / "noattn", cfg=lambda c: c.pop("attn_quantize")
    )
    out["glm4_moe_no_bias"] = _edit(out["glm4_moe"], e / "nobias", tensors=_no_bias)
    # mistral: refused (exit 2, nothing written); what it would be is a llama
    # artifact under model_type mistral (MindIE runs both with its llama model)
    msrc = root / "mistral-src"
    save_tiny(msrc, "mistral", vocab_size=1024)
    assert _calibrate(msrc, root / "mistral") == 2
    assert not (root / "mistral").exists()

    def as_mistral(c):
        c["model_type"] = "mistral"
        c["architectures"] = ["MistralForCausalLM"]

    out["mistral_refused"] = _edit(out["llama"], e / "mistral", cfg=as_mistral)
    for t in NO_MODEL:

        def retype(c, t=t):
            c["model_type"] = t
            c.pop("architectures", None)

        out[f"{t}_no_model"] = _edit(out["llama"], e / t, cfg=retype)
    return out


@pytest.fixture(scope="module")
def mindie(cases, tmp_path_factory) -> dict[str, dict]:
    """case -> MindIE's own record (``tests/mindie_own_driver.py``)."""
    src = _source_tree()
    python = _env_python()
    out = tmp_path_factory.mktemp("mindie_own_out") / "out.json"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    names = list(cases)
    proc = subprocess.run(
        [str(python), str(DRIVER), str(src), str(out), *(str(cases[n]) for n in names)],
        capture_output=True, text=True, timeout=3600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    records = dict(zip(names, data["results"], strict=True))
    records["_touched"] = data["touched"]
    return records


def _ours(art: Path) -> tuple[str, str | None]:
    """(the loader model's verdict, the tensor it failed on or None)."""
    from mindie_loader import MindieLoadError, load_artifact, unread_fa

    try:
        load = load_artifact(art)
    except MindieLoadError as exc:
        msg = str(exc)
        return "error", msg.split("weight ")[1].split(" ")[
            0
        ] if "weight " in msg else None
    return ("silent" if unread_fa(art, load) else "loads"), None


@pytest.mark.parametrize("case", list(EXPECTED))
def test_mindie_and_ours_agree(cases, mindie, case):
    from ascend_fa.artifact import inspect_artifact

    rec = mindie[case]
    assert rec["verdict"] == EXPECTED[case], rec
    art = cases[case]
    valid = inspect_artifact(art, target="mindie")["valid"]
    assert valid == (rec["verdict"] == "loads"), (case, rec)
    verdict, missing = _ours(art)
    assert verdict == rec["verdict"], (case, verdict, rec)
    if rec["verdict"] == "error" and rec["missing"]:
        # the same tensor MindIE stopped on
        assert missing == rec["missing"][-1], (case, missing, rec["missing"])
    if rec["verdict"] == "loads":
        assert not rec["unheld"] and not rec["fa_unread"], rec


def test_every_fa_tensor_is_read_where_mindie_builds_fa3(cases, mindie):
    from builders import artifact_tensors

    for fam in DENSE:
        fa = [n for n in artifact_tensors(cases[fam]) if ".fa_" in n]
        read = set(mindie[fam]["fa_read"])
        if fam in ("deepseek_v3", "kimi_k2"):  # FA3.load_mla: fa_q, fa_k scales
            fa = [n for n in fa if n.endswith(("fa_q.scale", "fa_k.scale"))]
        assert fa and set(fa) <= read and not mindie[fam]["fa_unread"], fam
        assert mindie[fam]["fa_quant_type"] in ("FAQuant", "FAKQuant"), fam


def test_the_stand_ins_ran_no_device_code(mindie):
    touched = mindie["_touched"]
    calls = [t for t in touched if t.startswith("call torch_npu.npu_")]
    assert all("format_cast" in t for t in calls), calls
    assert not [t for t in touched if t.startswith("refused")], touched


TABLE_START = "<!-- mindie-own-code table: start -->"
TABLE_END = "<!-- mindie-own-code table: end -->"


def render_table(mindie: dict[str, dict]) -> str:
    lines = [
        f"MindIE-LLM @{COMMIT[:8]} (v3.0.0), `{DRIVER.relative_to(ROOT)}`:",
        "",
        "| case | model class | quantize | verdict | tensors asked | detail |",
        "|---|---|---|---|---|---|",
    ]
    for case in EXPECTED:
        r = mindie[case]
        if r["verdict"] == "error":
            detail = f"{r['error']} ({r['frame']})"
        elif r["verdict"] == "silent":
            n = len(r["fa_unread"])
            detail = f"{n} fa_* tensors never read" if n else f"unheld: {r['unheld']}"
        elif r["fa_read"]:
            detail = f"every quantized tensor held; {len(r['fa_read'])} fa_* read"
        else:
            detail = "every quantized tensor held"
        detail = detail.replace("|", "/").replace("`", "'")
        lines.append(
            f"| {case} | {r.get('model_cls', '-')} | {r.get('quantize', '-')} "
            f"| {r['verdict']} | {len(r['asked'])} | {detail} |"
        )
    return "\n".join(lines)


def test_the_docs_table_is_this_run(mindie):
    table = render_table(mindie)
    text = DOC.read_text()
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = f"{head}{TABLE_START}\n{table}\n{TABLE_END}{tail}"
    if settings.get("ASCEND_FA_UPDATE_DOCS"):
        DOC.write_text(new)
    assert new == text, f"docs/reference/mindie.md differs from this run:\n{table}"
