"""The transformers versions ascend-fa supports, and every difference between them
the package depends on: one place, so that no other module tests a version.

Supported: transformers 4.57 (the last 4.x) and 5.x (:data:`SUPPORTED`). What differs
between them, and how this module bridges it:

==========================  ===========================  ============================
                            transformers 4.57            transformers 5
==========================  ===========================  ============================
attention function lookup   ``ALL_ATTENTION_FUNCTIONS``  ``.get_interface(impl,
                            ``[impl]``, ``eager`` from   eager)``
                            the modeling file
DeepSeek-V3 routed experts  one ``DeepseekV3MLP`` per    fused ``experts.gate_up_proj``
                            expert (``nn.Linear`` under  ``[E, 2I, H]`` / ``down_proj``
                            the checkpoint names)        parameters; checkpoint names
                                                         through weight conversions
weight-name conversions     none (in-memory names are    ``conversion_mapping`` /
                            the checkpoint names)        ``core_model_loading``
RoPE in config.json         ``rope_theta``,              ``rope_parameters`` (a
                            ``rope_scaling`` (it reads   dict with ``rope_theta``;
                            no ``rope_parameters``)      GGUF cache entries are
                                                         per major for this)
MLA latent at ``kv_b_proj``  ``[B, S, R]``, new tokens;    ``[B, 1, T, R]``, the whole
                            the cache holds expanded     cache (it holds latents)
                            K/V (fake-quant with a
                            cache needs 5)
tied weights                ``_tied_weights_keys`` (a    ``all_tied_weights_keys``
                            list, tied when the config   (the tied names of this
                            ties word embeddings)        model)
a forward's KV cache        ``past_key_values=`` in,     ``cache=`` in, ``.cache``
                            ``.past_key_values`` out     out (5.25)
==========================  ===========================  ============================

Loading takes ``dtype=`` in both (4.56 renamed ``torch_dtype``). Features only
transformers 5 can run raise :class:`~ascend_fa.errors.UnsupportedError` through
:func:`require_transformers5`, one line that says so.

Importing this module imports neither torch nor transformers; the installed version
is read from the distribution's metadata.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Callable
from typing import Any

from ascend_fa.errors import UnsupportedError

__all__ = [
    "SUPPORTED",
    "transformers_version",
    "version_tuple",
    "support_status",
    "is_transformers5",
    "files_tag",
    "require_transformers5",
    "attention_function",
    "rotary_dim",
    "used_weight_conversions",
    "revert_to_checkpoint_names",
    "checkpoint_prefix",
    "in_memory_prefix",
    "output_cache",
    "tied_weight_keys",
    "cache_kwargs",
    "family_config",
]

#: The range pyproject.toml's ``hf`` extra declares (keep the two equal).
SUPPORTED = ">=4.57,<6"
_LOWEST = (4, 57)
_BELOW = (6,)


def transformers_version() -> str | None:
    """The installed transformers version (None when not installed); no import."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric release of ``text``: ``"4.57.6"`` -> (4, 57, 6),
    ``"5.0.0rc1"`` -> (5, 0, 0), ``"5.1.dev0"`` -> (5, 1)."""
    parts: list[int] = []
    for piece in text.split("."):
        m = re.match(r"\d+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts)


def support_status(version: str | None = None) -> tuple[bool, str]:
    """(supported, one line) for ``version`` (default: the installed one)."""
    version = transformers_version() if version is None else version
    if version is None:
        return False, f"transformers not installed (supported: {SUPPORTED})"
    v = version_tuple(version)
    if _LOWEST <= v < _BELOW:
        return True, f"transformers {version} (supported: {SUPPORTED})"
    return False, f"transformers {version} is not supported (supported: {SUPPORTED})"


def is_transformers5() -> bool:
    """Whether the installed transformers is 5.x or newer."""
    version = transformers_version()
    return version is not None and version_tuple(version) >= (5,)


def files_tag() -> str:
    """``"tf<major>"`` of the installed transformers: what files it writes
    (``config.json`` RoPE keys, tokenizer files) are read back by the same major."""
    version = transformers_version()
    major = version_tuple(version)[:1] if version else ()
    return f"tf{major[0]}" if major else "tf-none"


def require_transformers5(feature: str) -> None:
    """Raise the one-line error for ``feature`` when transformers is older than 5."""
    if not is_transformers5():
        raise UnsupportedError(
            f"{feature} needs transformers 5 (installed: transformers "
            f"{transformers_version()}); pip install 'transformers>=5,<6'"
        )


def attention_function(module: Any, impl: str) -> Callable[..., Any]:
    """The attention function implementation ``impl`` runs for ``module`` (an
    attention module of a transformers model), as its ``forward`` looks it up.

    ``"eager"`` is not in the registry in either version: each modeling file passes
    its own ``eager_attention_forward``. transformers 5 looks up through
    ``get_interface`` (which also validates the name); 4.57 indexes the registry
    (huggingface/transformers v4.57.6 ``models/llama/modeling_llama.py``
    ``LlamaAttention.forward``).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    get_interface = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if get_interface is not None:
        return get_interface(impl, eager)
    return eager if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]


def used_weight_conversions(model: Any, names: list[str]) -> list[Any]:
    """The weight conversions transformers would apply to a checkpoint with tensor
    ``names`` when loading ``model`` (5.x ``conversion_mapping``); none in 4.57."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # 4.57: in-memory names are the checkpoint names
        return []
    return [
        c
        for c in get_model_conversion_mapping(model)
        if any(c.compiled_sources.search(n) for n in names)
    ]


def revert_to_checkpoint_names(model: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (in-memory names) under the names ``save_pretrained`` writes:
    through transformers 5's ``revert_weight_conversion``; unchanged in 4.57."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # 4.57: in-memory names are the checkpoint names
        return tensors
    return dict(revert_weight_conversion(model, tensors))


def checkpoint_prefix(model: Any) -> Callable[[str], str]:
    """The name map from ``model``'s in-memory tensor (or module) names to the
    prefixes of the checkpoint it was loaded from: transformers 5's
    ``PrefixChange`` conversions used by ``from_pretrained``, reversed (a
    multimodal wrapper's language model loaded as its causal LM: ``model.*`` ->
    ``model.language_model.*``); the identity when none was used (4.57, a model
    built from its config, a checkpoint without the prefix)."""
    try:
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # 4.57: in-memory names are the checkpoint names
        return _same
    used = getattr(model, "_weight_conversions", None) or []
    changes = [c.reverse_transform() for c in used if isinstance(c, PrefixChange)]
    return _renamer(changes[::-1])


def in_memory_prefix(model: Any) -> Callable[[str], str]:
    """The inverse of :func:`checkpoint_prefix`: checkpoint names (an artifact's)
    -> ``model``'s in-memory names, through the same ``PrefixChange`` conversions
    in their loading direction."""
    try:
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return _same
    used = getattr(model, "_weight_conversions", None) or []
    return _renamer([c for c in used if isinstance(c, PrefixChange)])


def _renamer(changes: list[Any]) -> Callable[[str], str]:
    if not changes:
        return _same
    compiled = [
        (re.compile(src), tgt)
        for c in changes
        for src, tgt in zip(c.source_patterns, c.target_patterns, strict=True)
    ]

    def rename(name: str) -> str:
        for pattern, target in compiled:
            name = pattern.sub(target, name, count=1)
        return name

    return rename


def _same(name: str) -> str:
    return name


def _cache_name() -> str:
    """What a model forward calls its KV cache (keyword and output field)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = CausalLMOutputWithPast.__dataclass_fields__
    return "cache" if "cache" in fields else "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a ``use_cache=True`` forward returned."""
    return getattr(output, _cache_name())


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword arguments that pass ``cache`` to a model's next forward."""
    return {_cache_name(): cache}


def tied_weight_keys(model: Any) -> set[str]:
    """Names of ``model``'s parameters that are tied to another one (not loaded
    under their own name): 5.x ``all_tied_weights_keys``; 4.57 the class's
    ``_tied_weights_keys`` when the config ties the word embeddings
    (huggingface/transformers v4.57.6 ``modeling_utils.py`` ``_tie_or_clone_weights``
    / ``tie_weights``)."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is not None:
        return set(tied)
    cfg = model.config.get_text_config()
    if not getattr(cfg, "tie_word_embeddings", False):
        return set()
    return set(getattr(model, "_tied_weights_keys", None) or ())


def rotary_dim(config: Any) -> int | None:
    """How many leading channels of a head RoPE rotates (rotate-half pairs over
    them), or None when it rotates the whole head: ``config.rotary_dim``
    (MiniMax-M2), else ``head_dim * partial_rotary_factor`` (GLM-4-MoE,
    Qwen3-Next), read at the top level (transformers 4) or in
    ``rope_parameters`` (transformers 5), as transformers' RoPE init computes it."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    try:
        head_dim = getattr(config, "head_dim", None) or (
            int(config.hidden_size) // heads if heads else None
        )
    except RuntimeError:
        # a heterogeneous config (Gemma 4: each layer type its own head_dim and
        # rope_parameters) refuses a global head_dim; its "proportional" RoPE
        # gives every rotate-half pair of the head a frequency (zero past
        # partial_rotary_factor), so the pairs span the whole head
        # (transformers ``modeling_rope_utils.py``
        # ``_compute_proportional_rope_parameters``, v5.25.0)
        return None
    explicit = getattr(config, "rotary_dim", None)
    if isinstance(explicit, int) and head_dim and 0 < explicit < int(head_dim):
        return explicit
    factor = getattr(config, "partial_rotary_factor", None)
    rope = getattr(config, "rope_parameters", None)
    if factor is None and isinstance(rope, dict):
        factor = rope.get("partial_rotary_factor")
    if not isinstance(factor, int | float) or not head_dim or not 0 < factor < 1:
        return None
    return int(int(head_dim) * float(factor))


def family_config(config: dict[str, Any]) -> Any:
    """The transformers config of ``config`` (a ``config.json`` as a dict), built
    by the class of the family that builds its ``model_type``
    (:func:`ascend_fa.families.built_as`): Kimi-K2's ``kimi_k2`` by
    ``DeepseekV3Config``. Such a config keeps its ``model_type`` in the file only:
    in memory it is the building family's, whose weight conversions (fused
    experts) transformers looks up by it; its ``auto_map`` (the checkpoint's own
    remote code, which is never run) is left out, so that transformers' own
    classes build it."""
    from transformers import AutoConfig

    from ascend_fa.families import built_as

    cfg = {k: v for k, v in config.items() if k not in ("model_type", "auto_map")}
    if built_as(config.get("model_type")) == config.get("model_type"):
        cfg["auto_map"] = config.get("auto_map")
        if cfg["auto_map"] is None:
            del cfg["auto_map"]
    return AutoConfig.for_model(built_as(config.get("model_type")), **cfg)
