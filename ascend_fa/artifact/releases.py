"""What each consumer release loads, as data.

:mod:`.consumers` replays one commit of each consumer's parser (vllm-ascend main,
MindIE 3.0.0). Users run releases, and releases differ: a table here says, per
release, which attention/KV scheme loads for which architecture, and every rule
cites the repository, path and commit (or tag) it was read from.

=================  ====================================  ===========================
release            loads                                 refused (what happens there)
=================  ====================================  ===========================
vllm-ascend        nothing quantized in attention        C8 for every GQA model
0.13.x (0.13.0)                                          (KeyError: '.weight' for
                                                         Llama / Mistral,
                                                         '...experts.weight' for
                                                         Mixtral / Qwen2-MoE,
                                                         '...qkv_proj.kv_cache_*'
                                                         for the others; Qwen3-Next
                                                         scales dropped, silently);
                                                         FAKQuant (tensors dropped,
                                                         latent cache stays bf16,
                                                         silently)
vllm-ascend        C8 for ``Qwen3ForCausalLM``;          C8 for Llama / Mistral /
0.18.x (0.18.0)    FAKQuant                              Qwen2 / Mixtral / Gemma 3
                                                         (one scale kept for every
                                                         channel, silently),
                                                         Qwen3-Next (scales dropped,
                                                         silently), Qwen3-MoE
                                                         (AssertionError), Qwen2-MoE
                                                         and others (KeyError)
vllm-ascend        C8 for ``Qwen3ForCausalLM``,          C8 for Llama / Mistral /
0.23.x             ``Glm4MoeForCausalLM``,               Qwen2 / Gemma 3 and others
(0.23.0.post1)     ``MiniMaxM2ForCausalLM``; FAKQuant    (KeyError
                                                         ``...qkv_proj.kv_cache_*``);
                                                         Qwen3-MoE, Qwen3-Next
                                                         (scales dropped, silently)
vllm-ascend        C8 for every architecture vLLM        C8 for ``Gemma3ForCausalLM``
0.25.1rc1, main    loads through ``AutoWeightsLoader``   (its C8 attention applies no
                   (``get_cache_scale_mapper``);         sliding window: wrong past
                   FAKQuant                              ``sliding_window`` tokens)
MindIE 3.0.0       FAQuant (llama, mistral, qwen2,       no MiniMax-M2 / Qwen3-Next /
                   qwen3), FAKQuant (deepseek_v2/v3);    Gemma 3 / GlmMoeDsa model;
                   the quantized linears only for the    FAQuant for the MoE models
                   MoE models (qwen2_moe, qwen3_moe,     (no FA3 there, silently);
                   mixtral, glm4_moe: no FA3) and        FAKQuant for DeepSeek-V3.2;
                   DeepSeek-V3.2 (:mod:`.mindie_models`) ``model_quant_type`` float
=================  ====================================  ===========================

vllm-ascend 0.13.0 / 0.18.0 (vLLM under transformers 4.57) cannot parse a
config.json with transformers 5's per-layer-type ``rope_parameters`` (Gemma 3
saved by transformers 5: ValidationError, rule ``config.per-layer-type-rope``,
:data:`.release_loader.CONFIG_RULES`), whatever the artifact quantizes.
Every vllm-ascend release: quantized routed experts of Mixtral / Qwen2-MoE
(KeyError ``...experts.weight``, :mod:`.release_loader`) and C8 for Qwen2-MoE.
Verdicts checked by running the release's own loader (0.23.0.post1, 0.18.0,
0.13.0; and 0.25.1rc1, main at 182b75ea in a local run) are marked "the real
loader" in their rule (:mod:`.release_loader`); the others come from reading the
code at the cited commit.

DeepSeek Sparse Attention models (``DeepseekV32ForCausalLM``,
``GlmMoeDsaForCausalLM``) run on vllm-ascend's SFA backend in every release, which
reads no FA scale, and on MindIE's runtime without FA3: the Ascend targets write
their quantized linears only (scheme ``linears``, :func:`release_scheme`); a
FAKQuant artifact of them is reported (rules ``fakquant.sfa``,
``mindie.fakquant-dsa``).

The default release of a target is its newest stable one (:data:`DEFAULT_RELEASE`):
vllm-ascend 0.23.0.post1, MindIE 3.0.0. The ``vllm`` target has no release table
(its rules are vLLM's compressed-tensors KV-cache scheme, :mod:`.consumers`).

Versions are named as the project publishes them (``0.23.0.post1``, ``0.25.1rc1``,
``main``); a leading ``v``, letter case and the release line (``0.23``,
``0.23.x``, and ``0.23.0`` for the 0.23 line, whose C8 files are identical in
0.23.0 and 0.23.0.post1) are accepted. Anything else is refused in one line: a
release not in the table has not been read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.families import is_mla, reads_fa

from .mindie_models import MINDIE_MOE_NO_FA3, MINDIE_NO_MODEL
from .release_dsa import DSA_RULES
from .release_loader import LOADER_RULES, config_refusal
from .release_types import MAIN as _MAIN
from .release_types import MINDIE, VLLM, VLLM_ASCEND, Citation, Release, Rule
from .release_types import MINDIE300 as _MINDIE300
from .release_types import PR12463 as _PR12463
from .release_types import V013 as _V013
from .release_types import V018 as _V018
from .release_types import V023 as _V023
from .release_types import V0251 as _V0251
from .release_unmapped import UNMAPPED_RULES

logger = logging.getLogger(__name__)

__all__ = [
    "Citation",
    "Release",
    "Rule",
    "RELEASES",
    "RULES",
    "DEFAULT_RELEASE",
    "DEFAULT_MODEL_CONFIG",
    "architecture",
    "resolve_release",
    "release_scheme",
    "rule_for",
    "first_loading",
    "release_findings",
    "release_notes",
    "check_release",
]

RELEASES: tuple[Release, ...] = (
    Release("vllm-ascend", "0.13.0", "0.13.x", _V013, "vLLM v0.13.0", True),
    Release("vllm-ascend", "0.18.0", "0.18.x", _V018, "vLLM v0.18.0", True),
    Release(
        "vllm-ascend",
        "0.23.0.post1",
        "0.23.x",
        _V023,
        "vLLM v0.23.0",
        True,
        aliases=("0.23.0",),
    ),
    Release("vllm-ascend", "0.25.1rc1", "0.25.1rc1+", _V0251, "vLLM v0.25.1", False),
    Release("vllm-ascend", "main", "main", _MAIN, "vLLM v0.27.1", False),
    Release("mindie", "3.0.0", "3.0.x", _MINDIE300, "atb_llm", True),
)

#: The release a target is judged for when none is named: its newest stable one.
DEFAULT_RELEASE = {
    t: [r for r in RELEASES if r.target == t and r.stable][-1].name
    for t in ("vllm-ascend", "mindie")
}

#: config.json ``model_type`` -> the architecture vLLM instantiates, for the model
#: types ascend-fa calibrates (a config's own ``architectures`` wins).
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
}
#: What ``calibrate`` without ``--model`` loads: the demo SmolLM2-135M-Instruct GGUF
#: (:data:`ascend_fa.models.DEFAULT_GGUF_FILE`), a Llama (the tests read its GGUF
#: header to keep this true).
DEFAULT_MODEL_CONFIG = {"model_type": "llama"}
#: GGUF ``general.architecture`` -> transformers model_type.
_GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


_GQA_C8_PATCHED = frozenset(
    {"Qwen3ForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM"}
)
_LATER = ("0.25.1rc1", "main")
#: Architectures vllm-ascend has no quantization mapping for at any release here.
_NO_QUANT_MAPPING = frozenset(
    {"GptOssForCausalLM", "Llama4ForCausalLM", "Llama4ForConditionalGeneration"}
)
RULES: tuple[Rule, ...] = (
    Rule(
        "quant.no-mapping",
        "vllm-ascend",
        "*",
        ("0.13.0", "0.18.0", "0.23.0.post1", *_LATER),
        _NO_QUANT_MAPPING,
        False,
        "no quantization mapping for gpt_oss / llama4 (no "
        "packed_modules_model_mapping entry: vLLM's fused qkv_proj and experts "
        "find no checkpoint names in quant_model_description.json), and serves "
        "them bf16 only; use --target vllm (FP8 KV-cache scales)",
        (
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/modelslim_config.py",
                _V023,
                "packed_modules_model_mapping",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/modelslim_config.py",
                _MAIN,
                "packed_modules_model_mapping",
            ),
        ),
        verb="cannot quantize",
    ),
    *UNMAPPED_RULES,
    *DSA_RULES,
    *LOADER_RULES,
    Rule(
        "c8.qwen3-patch",
        "vllm-ascend",
        "C8",
        ("0.18.0",),
        frozenset({"Qwen3ForCausalLM"}),
        True,
        "Qwen3ForCausalLM.load_weights patched to load the [Hkv*D] scales whole",
        (Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_qwen3_c8.py", _V018),),
    ),
    Rule(
        "c8.qwen3-only",
        "vllm-ascend",
        "C8",
        ("0.18.0",),
        None,
        False,
        "maps C8 scales for Qwen3ForCausalLM only; for others vLLM's loader "
        "renames k_proj to qkv_proj and raises KeyError "
        "'<attn>.qkv_proj.kv_cache_offset' (the real loader: GLM-4.5, MiniMax-M2)",
        (
            Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_qwen3_c8.py", _V018),
            Citation(
                VLLM,
                "vllm/model_executor/models/glm4_moe.py",
                "v0.18.0",
                "Glm4MoeModel.load_weights L528; minimax_m2.py L442",
            ),
        ),
    ),
    Rule(
        "c8.gqa-patch",
        "vllm-ascend",
        "C8",
        ("0.23.0.post1",),
        _GQA_C8_PATCHED,
        True,
        "load_weights of Qwen3 / Glm4Moe / MiniMaxM2 patched to route the C8 scales",
        (Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_gqa_c8.py", _V023),),
    ),
    Rule(
        "c8.unpatched-arch",
        "vllm-ascend",
        "C8",
        ("0.23.0.post1",),
        None,
        False,
        "maps C8 scales only for Qwen3ForCausalLM, Glm4MoeForCausalLM, "
        "MiniMaxM2ForCausalLM; for others vLLM's loader renames k_proj to "
        "qkv_proj and raises KeyError '<attn>.qkv_proj.kv_cache_offset' (the real "
        "loader: Llama, Mistral, Qwen2, Mixtral, Gemma 3)",
        (
            Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_gqa_c8.py", _V023),
            Citation(
                VLLM, "vllm/model_executor/models/llama.py", "v0.23.0", "load_weights"
            ),
            Citation(
                VLLM, "vllm/model_executor/models/qwen2.py", "v0.23.0", "load_weights"
            ),
            Citation(
                VLLM,
                "vllm/model_executor/models/gemma3.py",
                "v0.23.0",
                "Gemma3Model.load_weights L413",
            ),
        ),
    ),
    # Gemma 3 alternates sliding-window and full layers. vllm-ascend's C8 attention
    # (AscendC8AttentionBackendImpl, swapped in for every C8 layer by
    # AscendC8KVCacheAttentionMethod.create_weights) passes no window to its FIA
    # calls (decode sparse_mode=0, prefill sparse_mode=3, no pre_tokens), while
    # its float attention applies it (sparse_mode=4, pre_tokens=sliding_window).
    Rule(
        "c8.no-sliding-window",
        "vllm-ascend",
        "C8",
        _LATER,
        frozenset({"Gemma3ForCausalLM"}),
        False,
        "loads the C8 scales, but its C8 attention applies no sliding window "
        "(decode sparse_mode=0, prefill sparse_mode=3): Gemma 3's sliding layers "
        "attend past sliding_window tokens, unlike the model, without an error",
        (
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/attention/attention_v1.py",
                _V0251,
                "AscendC8AttentionBackendImpl._forward_c8_decode / "
                "_forward_c8_fused_infer_attention",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/attention/attention_v1.py",
                _MAIN,
                "AscendC8AttentionBackendImpl._forward_c8_decode",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/methods/kv_c8.py",
                _V0251,
                "create_weights: layer.impl.__class__ = AscendC8AttentionBackendImpl",
            ),
        ),
        verb="cannot run",
    ),
    Rule(
        "c8.cache-scale-mapper",
        "vllm-ascend",
        "C8",
        _LATER,
        None,
        True,
        "get_cache_scale_mapper (PR #12463) renames the C8 tensors for every "
        "model vLLM loads through AutoWeightsLoader (the real loader, 0.25.1rc1 "
        "and main at 182b75ea: llama, qwen2, qwen3, mixtral, qwen3_moe C8 held "
        "bit for bit)",
        (
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/modelslim_config.py",
                _PR12463,
                "get_cache_scale_mapper (PR #12463; first tag v0.25.1rc1)",
            ),
            Citation(
                VLLM,
                "vllm/model_executor/models/utils.py",
                "v0.25.1",
                "AutoWeightsLoader.load_weights",
            ),
        ),
    ),
    Rule(
        "fakquant.dropped",
        "vllm-ascend",
        "FAKQuant",
        ("0.13.0",),
        None,
        False,
        "registers no FAKQuant scheme and its DeepSeek loader skips tensors it has "
        "no parameter for: the fa_* scales are dropped and the latent cache stays "
        "bf16, silently (the real loader, up to process_weights_after_loading, "
        "whose shared-expert self-check computes on the NPU: "
        "vllm_ascend/ops/fused_moe/fused_moe.py L474-483 at v0.13.0)",
        (
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/quant_config.py",
                _V013,
                "get_quant_method",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/patch/worker/patch_deepseekv3.py",
                _V013,
                "load_weights: name not in params_dict -> continue",
            ),
        ),
        silent=True,
    ),
    Rule(
        "fakquant.scheme",
        "vllm-ascend",
        "FAKQuant",
        ("0.18.0", "0.23.0.post1", *_LATER),
        None,
        True,
        "register_scheme('FAKQuant', 'attention'); fa_* names mapped to the MLA "
        "attention (the real loader, every release here but 0.13.0)",
        (
            Citation(VLLM_ASCEND, "vllm_ascend/quantization/methods/kv_c8.py", _V018),
            Citation(
                VLLM_ASCEND, "vllm_ascend/patch/worker/patch_weight_utils.py", _V018
            ),
        ),
    ),
    # MindIE per family: ascend_fa.artifact.mindie_models holds the whole table
    # (backend, FA3, quantize source, expert precision), cited line by line.
    Rule(
        "mindie.no-model",
        "mindie",
        "*",
        ("3.0.0",),
        MINDIE_NO_MODEL,
        True,
        "MindIE has no model for this architecture (no atb_llm/models nor "
        "mindie_llm/runtime/models folder: NotImplementedError 'unsupported model "
        "type'): calibrate refuses it but for a research run, inspect finds it "
        "(ascend_fa.artifact.mindie_models)",
        (
            Citation(
                MINDIE,
                "examples/atb_models/atb_llm/models/__init__.py",
                _MINDIE300,
                "L94-97 get_model: 'unsupported model type'",
            ),
            Citation(
                MINDIE,
                "mindie_llm/runtime/models/__init__.py",
                _MINDIE300,
                "L47-48 get_router_ins: 'unsupported model type'",
            ),
        ),
        caveat=True,
    ),
    Rule(
        "mindie.fa3.moe",
        "mindie",
        "FAQuant",
        ("3.0.0",),
        MINDIE_MOE_NO_FA3,
        False,
        "the MoE models build no FA3 (no enableFA3; qwen2_moe / qwen3_moe never "
        "read the description): the fa_* tensors go unused while mixtral and "
        "glm4_moe allocate an int8 KV cache for fa_quant_type FAQuant; --target "
        "mindie writes their quantized linears only",
        (
            Citation(
                MINDIE,
                "examples/atb_models/atb_llm/models/qwen2_moe/flash_causal_qwen2_moe.py",
                _MINDIE300,
                "no enableFA3",
            ),
            Citation(
                MINDIE,
                "examples/atb_models/atb_llm/runner/model_runner.py",
                _MINDIE300,
                "L290-292 int8 KV cache when fa_quant_type == FAQuant",
            ),
        ),
        silent=True,
    ),
    Rule(
        "mindie.fa3",
        "mindie",
        "FAQuant",
        ("3.0.0",),
        None,
        True,
        "llama / qwen2 flash-causal models build FA3 (mistral routes to llama, "
        "qwen3 to qwen2)",
        (
            Citation(
                MINDIE,
                "examples/atb_models/atb_llm/models/llama/flash_causal_llama.py",
                _MINDIE300,
                "enableFA3",
            ),
            Citation(
                MINDIE,
                "examples/atb_models/atb_llm/models/qwen2/flash_causal_qwen2.py",
                _MINDIE300,
                "enableFA3",
            ),
        ),
    ),
    Rule(
        "mindie.fakquant",
        "mindie",
        "FAKQuant",
        ("3.0.0",),
        None,
        True,
        "deepseek_v2/v3 route to deepseekv2, which builds FA3",
        (
            Citation(
                MINDIE,
                "examples/atb_models/atb_llm/models/deepseekv2/"
                "flash_causal_deepseekv2.py",
                _MINDIE300,
            ),
        ),
    ),
)


def _releases(target: str) -> list[Release]:
    return [r for r in RELEASES if r.target == target]


def _normal(version: str) -> str:
    v = version.strip().lower()
    return v[1:] if v.startswith("v") and v[1:2].isdigit() else v


def resolve_release(target: str, version: str | None) -> Release | None:
    """The release ``version`` of ``target`` names (None: the target's default;
    None for the ``vllm`` target, which has no release table). A version the
    table does not hold, or one of another target, is an :class:`InputError`."""
    known = _releases(target)
    if not known:
        if version is None:
            return None
        raise InputError(
            f"--consumer-version {version!r}: --target {target} has no release "
            "table (vllm-ascend and mindie releases are; see "
            "docs/reference/compatibility.md)"
        )
    if version is None:
        version = DEFAULT_RELEASE[target]
    v = _normal(str(version))
    for r in known:
        series = r.line.removesuffix(".x").removesuffix("+")
        if v in (r.name, *r.aliases, r.line, series):
            return r
    other = [
        r.target
        for r in RELEASES
        if r.target != target and v in (r.name, *r.aliases, r.line)
    ]
    hint = f" (that is a {other[0]} release)" if other else ""
    raise InputError(
        f"--consumer-version {version!r} is not a {target} release in the table"
        f"{hint}; choose one of {', '.join(r.name for r in known)}"
    )


def architecture(config: Mapping[str, Any] | None) -> str | None:
    """The architecture a consumer instantiates: ``architectures[0]`` of the
    config, else the one of its ``model_type``; None when nothing says."""
    cfg = config or {}
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return _ARCHITECTURES.get(str(cfg.get("model_type")))


def release_scheme(target: str, mla: bool, fa: bool = True) -> str | None:
    """The attention/KV scheme ``target`` writes: FAKQuant for MLA, C8
    (vllm-ascend) or FAQuant (mindie) for GQA; ``"linears"`` when it writes no
    attention scales for the model (``fa`` False: DeepSeek Sparse Attention);
    None for vllm."""
    if target == "vllm":
        return None
    if not fa:
        return "linears"
    if mla:
        return "FAKQuant"
    return "C8" if target == "vllm-ascend" else "FAQuant"


def rule_for(release: Release, scheme: str, arch: str | None) -> Rule | None:
    """The first rule of ``release`` for ``scheme`` covering ``arch``."""
    for rule in RULES:
        if rule.target != release.target or rule.scheme not in (scheme, "*"):
            continue
        if release.name not in rule.releases:
            continue
        if rule.architectures is None or arch in rule.architectures:
            return rule
    return None


def first_loading(target: str, scheme: str, arch: str | None) -> Release | None:
    """The oldest release of ``target`` that loads ``scheme`` for ``arch``."""
    for r in _releases(target):
        rule = rule_for(r, scheme, arch)
        if rule is not None and rule.loads:
            return r
    return None


def _refusal(release: Release, scheme: str, arch: str | None) -> str | None:
    rule = rule_for(release, scheme, arch)
    if rule is None or rule.loads:
        return None
    first = first_loading(release.target, scheme, arch)
    fix = (
        f"; {first.name} is the first release that loads it "
        f"(--consumer-version {first.name})"
        if first
        else "; no release in the table loads it"
    )
    what = rule.verb or ("silently ignores" if rule.silent else "cannot load")
    return (
        f"{release.target} {release.name} {what} {scheme} for {arch or 'this model'}"
        f" [{rule.id}]: {rule.effect}{fix} ({rule.cites()})"
    )


def release_notes(
    target: str, release: Release | None, scheme: str | None, arch: str | None
) -> list[str]:
    """What ``release`` loads but leaves unused for ``arch`` (a ``caveat`` rule),
    one line with the rule and its citation; empty otherwise."""
    if release is None or scheme is None:
        return []
    rule = rule_for(release, scheme, arch)
    if rule is None or not rule.caveat:
        return []
    return [
        f"{release.target} {release.name} loads {scheme} for {arch} but "
        f"[{rule.id}]: {rule.effect} ({rule.cites()})"
    ]


def release_findings(
    target: str, release: Release | None, scheme: str | None, arch: str | None
) -> list[str]:
    """``inspect``'s finding (release, rule, citation) when ``release`` does not
    load ``scheme`` for ``arch``; empty when it does or nothing is known."""
    if release is None or scheme is None:
        return []
    line = _refusal(release, scheme, arch)
    return [line] if line else []


def _gguf_config(model: Path, gguf_file: str | None) -> dict[str, Any] | None:
    """``{"model_type": ...}`` from a GGUF header (no tensor is read)."""
    path = model / gguf_file if gguf_file else model
    if path.suffix != ".gguf" or not path.is_file():
        return None
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except Exception:  # noqa: BLE001 - an unreadable header is the loader's error
        return None
    model_type = _GGUF_MODEL_TYPES.get(arch)
    return {"model_type": model_type} if model_type else None


def check_release(
    target: str | None,
    version: str | None,
    model: str | Path | None = None,
    gguf_file: str | None = None,
    *,
    config: Mapping[str, Any] | None = None,
) -> str:
    """``calibrate``'s refusal before any work; returns the resolved target.

    The release ``version`` of ``target`` (:func:`resolve_release`) must load what
    ``target`` writes for ``model``, read from its ``config.json`` (or ``config``,
    or a GGUF header; :data:`DEFAULT_MODEL_CONFIG` when ``model`` is None). Otherwise an
    :class:`UnsupportedError` says in one line what that release cannot load (or
    would load wrongly), the rule with its citation, and the first release that
    loads it. A model whose type cannot be read here, or is not one ascend-fa
    calibrates, is let through (the loader or the adapter registry reports it)."""
    from .targets import resolve_target

    target = resolve_target(target)
    release = resolve_release(target, version)
    if release is None:
        return target
    if config is None and model is not None:
        src = Path(model)
        config = _json(src / "config.json") or _gguf_config(src, gguf_file)
    elif config is None:
        config = DEFAULT_MODEL_CONFIG
    if not config or config.get("model_type") not in _ARCHITECTURES:
        return target  # not a model type ascend-fa calibrates: the loader says
    mla = is_mla(config.get("model_type")) or bool(config.get("kv_lora_rank"))
    scheme = str(
        release_scheme(target, mla, reads_fa(config.get("model_type"), target))
    )
    arch = architecture(config)
    # the artifact's config.json (the source's, with its transformers-4 RoPE
    # keys) is parsed before anything loads
    from .model_files import with_transformers4_rope

    line = config_refusal(target, release.name, with_transformers4_rope(config))
    line = line or _refusal(release, scheme, arch)
    if line:
        raise UnsupportedError(f"--consumer-version {release.name}: {line}")
    for note in release_notes(target, release, scheme, arch):
        logger.warning("%s", note)
    return target


def _json(path: Path) -> dict[str, Any] | None:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
