"""What each torch_npu release lets the ``npu`` backend call, as data.

One table, per Ascend Extension for PyTorch release (the op-plugin branches
``7.1.0``, ``7.2.0``, ``7.3.0`` and ``26.0.0``), states:

* **calls** (:data:`CALLS`): which torch_npu functions exist and their exact schema,
  copied from that branch's ``op_plugin/config/op_plugin_functions.yaml`` (ATB ops
  from their ``m.def`` in ``op_plugin/ops/atb/*.cpp``). :class:`Signature` parses a
  schema, so "does this release take ``cache_mode``?" is a lookup, not an ``if``;
* **routes** (:data:`ROUTES`): which calls serve which ``(op, mode, layout)``, and
  from which release;
* **rules** (:data:`RULES`): the documented dtype / shape / layout / head-count
  constraints, each with the release(s) it holds for and a citation (repo, path,
  commit) beside it. ``kind="spec"`` rules are checked against an
  :class:`~ascend_fa.backends.base.AttentionSpec` before any device call;
  ``kind="argument"`` rules constrain the arguments the mapping passes (the tests'
  strict fake of torch_npu enforces both kinds, by rule id).

:func:`unsupported_reasons` reads the table. Every reason names the rule id, the
offending value, what is allowed, and the release, e.g. ``[fia.int8nz.heads] ...:
(num_heads, num_kv_heads) = (32, 8), allowed one of (10, 1), (64, 8), (80, 8),
(128, 16) (torch_npu 26.0.0; Ascend/op-plugin:docs/...)``.

Adding an op (e.g. ``npu_quant_matmul`` for a new ``ascend_fa::quant_matmul``):

1. add its schema per release to ``_SCHEMAS`` (yaml text and line, or the ATB
   ``m.def``); :data:`CALLS` picks it up;
2. add a :class:`Route` naming the spec ``op`` (add the op name to
   ``ATTENTION_OPS`` in :mod:`ascend_fa.backends.base` or give the new module its own
   spec builder) and the calls it needs;
3. add :class:`Rule` entries with a ``Citation`` each (``kind="spec"`` for what can
   be refused from shapes and dtypes, ``kind="argument"`` for how the mapping must
   pass arguments);
4. write the mapping in :mod:`ascend_fa.backends.npu_kernels` and register it for the
   PrivateUse1 key in :func:`ascend_fa.backends.npu.register_npu_kernels`;
5. give the strict fake in ``tests/strict_fake_torch_npu`` an implementation that
   binds the schema, enforces each new rule id (a test checks that every rule id is
   enforced) and writes the bytes the device writes.

Sources, where they disagree, and which one wins:

* the yaml of each branch is authoritative for names and keywords (it is what the
  binding is generated from);
* the ``docs`` pages state the dtype / shape rules; where vllm-ascend's working calls
  go beyond a page (e.g. it passes a 5-D view to ``npu_scatter_pa_kv_cache`` where
  the page documents 4-D caches) we follow the page, the narrower contract;
* op-plugin's own tests decide argument placement the pages leave open (e.g. the
  host ``context_lens`` of ``_npu_paged_attention_quant``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from .base import AttentionSpec, LinearSpec

__all__ = [
    "RELEASES",
    "DEFAULT_RELEASE",
    "RELEASE_ENV_VAR",
    "OP_PLUGIN",
    "OP_PLUGIN_COMMITS",
    "VLLM_ASCEND",
    "VLLM_ASCEND_COMMIT",
    "FIA_INT8_NZ_HEAD_PAIRS",
    "Citation",
    "Param",
    "Signature",
    "CallSpec",
    "Route",
    "Rule",
    "OneOf",
    "Multiple",
    "PowerOfTwo",
    "AtMost",
    "CALLS",
    "ROUTES",
    "RULES",
    "LINEAR_RULES",
    "parse_schema",
    "call_spec",
    "route_for",
    "rules_for",
    "rule",
    "spec_value",
    "unsupported_reasons",
    "release_index",
]

#: Ascend Extension for PyTorch releases (op-plugin branches) the table covers,
#: oldest first.
RELEASES = ("7.1.0", "7.2.0", "7.3.0", "26.0.0")
#: Release assumed when no torch_npu is loaded and nothing else says (newest).
DEFAULT_RELEASE = "26.0.0"
#: Environment variable naming the release explicitly (overrides detection).
RELEASE_ENV_VAR = "ASCEND_FA_TORCH_NPU_RELEASE"

OP_PLUGIN = "Ascend/op-plugin"
#: Head commit of each op-plugin release branch the table was read from.
OP_PLUGIN_COMMITS = {
    "7.1.0": "57c52665a1e1b007f10a3dbce00d37929c3c851a",
    "7.2.0": "738effc0fe0d004af0f9c54ef7d781e08b095551",
    "7.3.0": "b3065ed3ed174b08b7ecfcc564c0c464fb91fd13",
    "26.0.0": "6ffd6e22ad4ea0fe6f20d6c8d249b772e92191d4",
}
VLLM_ASCEND = "vllm-project/vllm-ascend"
VLLM_ASCEND_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"

#: (num_heads, num_key_value_heads) the int8 NZ antiquant decode supports.
FIA_INT8_NZ_HEAD_PAIRS = ((10, 1), (64, 8), (80, 8), (128, 16))

_YAML = "op_plugin/config/op_plugin_functions.yaml"


def release_index(release: str) -> int:
    """Position of ``release`` in :data:`RELEASES` (raises ``ValueError`` naming the
    known releases for anything else)."""
    if release not in RELEASES:
        raise ValueError(
            f"unknown torch_npu release {release!r}; known: {', '.join(RELEASES)}"
        )
    return RELEASES.index(release)


# -- citations ------------------------------------------------------------------------
@dataclass(frozen=True)
class Citation:
    """Where a fact was read: repository, path, commit and (optionally) the place."""

    repo: str
    path: str
    commit: str
    where: str = ""

    def __str__(self) -> str:
        at = f" ({self.where})" if self.where else ""
        return f"{self.repo}:{self.path}@{self.commit[:10]}{at}"


def _doc_path(release: str, call: str) -> str:
    # The 7.x branches keep the pages under docs/context/; 26.0.0 moved them to
    # docs/zh/custom_APIs/torch_npu/ (and added an English copy).
    if release == "26.0.0":
        return f"docs/zh/custom_APIs/torch_npu/torch_npu-{call}.md"
    return f"docs/context/torch_npu-{call}.md"


def _doc(release: str, call: str, where: str) -> Citation:
    return Citation(
        OP_PLUGIN, _doc_path(release, call), OP_PLUGIN_COMMITS[release], where
    )


def _docs(call: str, lines: dict[str, str]) -> tuple[Citation, ...]:
    return tuple(_doc(r, call, w) for r, w in lines.items())


def _src(release: str, path: str, where: str) -> Citation:
    return Citation(OP_PLUGIN, path, OP_PLUGIN_COMMITS[release], where)


def _vllm(path: str, where: str) -> Citation:
    return Citation(VLLM_ASCEND, path, VLLM_ASCEND_COMMIT, where)


# -- schemas --------------------------------------------------------------------------
_REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One argument of a schema: ``Tensor? block_table=None``."""

    name: str
    type: str
    default: object = _REQUIRED
    keyword_only: bool = False

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    @property
    def optional_type(self) -> bool:
        """``Tensor?``, ``int?``: None is a legal value."""
        return self.type.endswith("?")

    @property
    def base_type(self) -> str:
        """The type without ``?`` and alias marks: ``Tensor(a!)`` -> ``Tensor``."""
        return re.sub(r"\(.*?\)", "", self.type).rstrip("?")


@dataclass(frozen=True)
class Signature:
    """A parsed schema ``name(args) -> returns``."""

    name: str
    params: tuple[Param, ...]
    returns: str

    @property
    def keywords(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def accepts(self, keyword: str) -> bool:
        return keyword in self.keywords

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no argument {name!r}")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _default(text: str) -> object:
    text = text.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[:1] in "'\"":
        return text[1:-1]
    if text.startswith("["):
        return [_default(v) for v in _split_top(text[1:-1])]
    return float(text) if any(c in text for c in ".e") else int(text)


def parse_schema(schema: str) -> Signature:
    """Parse a native-functions schema (the ``func:`` text of the yaml)."""
    m = re.fullmatch(r"\s*([\w.]+)\((.*)\)\s*->\s*(.+?)\s*", schema, flags=re.S)
    if m is None:
        raise ValueError(f"not a schema: {schema!r}")
    name, body, returns = m.groups()
    params: list[Param] = []
    keyword_only = False
    for part in _split_top(body):
        if part == "*":
            keyword_only = True
            continue
        decl, _, default = part.partition("=")
        type_, _, pname = decl.strip().rpartition(" ")
        params.append(
            Param(
                pname,
                type_.strip(),
                _default(default) if default else _REQUIRED,
                keyword_only,
            )
        )
    return Signature(name, tuple(params), returns)


@dataclass(frozen=True)
class CallSpec:
    """One torch_npu function in one release.

    ``binding`` is ``"op_plugin"`` for functions generated from the yaml (a wrong
    keyword raises ``TypeError``), ``"atb"`` for ATB ops exposed through
    ``torch.ops.atb`` (``torch_npu.<name>``).
    """

    name: str
    release: str
    signature: Signature
    binding: str
    cite: Citation


_FIA_V1 = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, "
    "Tensor? pse_shift=None, Tensor? atten_mask=None, "
    "SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, "
    "Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
    "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
    "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, "
    "Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
    "Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
    "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, "
    "Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
    "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, "
    "int num_heads=1, float scale=1.0, int pre_tokens=2147483647, "
    'int next_tokens=2147483647, str input_layout="BSH", '
    "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, "
    "int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
    "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)"
)
_FIA_V2_HEAD = (
    "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, "
    "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
    "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, "
    "Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, "
    "Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
    "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, "
    "Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, "
)
_FIA_V2_TAIL = (
    "Tensor? learnable_sink=None, int num_query_heads=1, "
    "int num_key_value_heads=0, float softmax_scale=1.0, "
    "int pre_tokens=2147483647, int next_tokens=2147483647, "
    'str input_layout="BSH", int sparse_mode=0, int block_size=0, '
    "int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, "
    "int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, "
    "int? key_dtype=None, int? value_dtype=None, int? query_rope_dtype=None, "
    "int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
    "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
    "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, "
    "int? dequant_scale_key_rope_dtype=None"
)
_SCATTER_HEAD = (
    "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
    "Tensor(b!) value_cache, Tensor slot_mapping, *, Tensor? compress_lens=None, "
    "Tensor? compress_seq_offsets=None, Tensor? seq_lens=None"
)
_QUANTIZE = (
    "npu_quantize(Tensor self, Tensor scales, Tensor? zero_points, {dtype} dtype, "
    "int axis=1, bool div_mode=True) -> Tensor"
)
_QUANT_MATMUL_HEAD = (
    "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
    "Tensor? pertoken_scale=None, Tensor? bias=None, "
)
_DYNAMIC_QUANT_HEAD = (
    "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, "
    "Tensor? group_index=None, "
)
_RESHAPE_AND_CACHE = (
    "_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
    "Tensor(b!) value_cache, Tensor slot_indices) -> ()"
)
_PA_QUANT = (
    "_npu_paged_attention_quant(Tensor query, Tensor key_cache, Tensor value_cache, "
    "int num_kv_heads, int num_heads, float scale_value, Tensor block_table, "
    "Tensor context_lens, int quant_type, int outdata_type, Tensor k_descale, "
    "Tensor v_descale, Tensor(a!) out) -> ()"
)

#: (schema, binding, {release: where the text is}) per call. A release missing from
#: the mapping does not have the call.
_SCHEMAS: dict[str, list[tuple[str, str, dict[str, Citation]]]] = {
    "npu_fused_infer_attention_score": [
        (
            _FIA_V1,
            "op_plugin",
            {
                r: _src(r, _YAML, f"line {ln}")
                for r, ln in (
                    ("7.1.0", 6852),
                    ("7.2.0", 5873),
                    ("7.3.0", 5898),
                    ("26.0.0", 5968),
                )
            },
        )
    ],
    "npu_fused_infer_attention_score_v2": [
        (
            _FIA_V2_HEAD + _FIA_V2_TAIL + ") -> (Tensor, Tensor)",
            "op_plugin",
            {
                "7.2.0": _src("7.2.0", _YAML, "line 5886"),
                "7.3.0": _src("7.3.0", _YAML, "line 5915"),
            },
        ),
        (
            _FIA_V2_HEAD
            + "Tensor? quant_scale_p=None, "
            + _FIA_V2_TAIL
            + ", int? out_dtype=None) -> (Tensor, Tensor)",
            "op_plugin",
            {"26.0.0": _src("26.0.0", _YAML, "line 5985")},
        ),
    ],
    "npu_scatter_pa_kv_cache": [
        (
            _SCATTER_HEAD + ") -> ()",
            "op_plugin",
            {
                "7.2.0": _src("7.2.0", _YAML, "line 6422"),
                "7.3.0": _src("7.3.0", _YAML, "line 6493"),
            },
        ),
        (
            _SCATTER_HEAD + ", str? cache_mode='PA_NZ') -> ()",
            "op_plugin",
            {"26.0.0": _src("26.0.0", _YAML, "line 6715")},
        ),
    ],
    "npu_quantize": [
        (
            _QUANTIZE.format(dtype="ScalarType"),
            "op_plugin",
            {
                r: _src(r, _YAML, f"line {ln}")
                for r, ln in (("7.1.0", 7242), ("7.2.0", 6292), ("7.3.0", 6363))
            },
        ),
        (
            # 26.0.0 types dtype as int; the binding converts a torch.dtype to its
            # enum, and op-plugin's own test passes torch.qint8
            # (test/test_custom_ops/test_npu_quantize.py).
            _QUANTIZE.format(dtype="int"),
            "op_plugin",
            {"26.0.0": _src("26.0.0", _YAML, "line 6592")},
        ),
    ],
    # The yaml's "custom" section; 7.1.0 also keeps a torch 2.0-only overload with
    # a positional ``str? output_dtype`` (op_api: v2.0), which the table leaves out.
    "npu_quant_matmul": [
        (
            _QUANT_MATMUL_HEAD
            + "ScalarType? output_dtype=None, SymInt[]? group_sizes=None) -> Tensor",
            "op_plugin",
            {
                r: _src(r, _YAML, f"line {ln}")
                for r, ln in (("7.1.0", 7203), ("7.2.0", 6257), ("7.3.0", 6328))
            },
        ),
        (
            # 26.0.0 types output_dtype as int; vllm-ascend passes a torch.dtype
            # (methods/w8a8_static.py, apply: output_dtype=layer.params_dtype)
            _QUANT_MATMUL_HEAD
            + "int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None, "
            "int? pertoken_scale_dtype=None, int? scale_dtype=None, "
            "int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor",
            "op_plugin",
            {"26.0.0": _src("26.0.0", _YAML, "line 6552")},
        ),
    ],
    "npu_dynamic_quant": [
        (
            _DYNAMIC_QUANT_HEAD + "ScalarType? dst_type=None) -> (Tensor, Tensor)",
            "op_plugin",
            {
                r: _src(r, _YAML, f"line {ln}")
                for r, ln in (("7.1.0", 6814), ("7.2.0", 5841), ("7.3.0", 5864))
            },
        ),
        (
            _DYNAMIC_QUANT_HEAD + 'int? dst_type=None, str quant_mode="pertoken", '
            "float dst_type_max=0.0) -> (Tensor, Tensor)",
            "op_plugin",
            {"26.0.0": _src("26.0.0", _YAML, "line 5906")},
        ),
    ],
    "_npu_reshape_and_cache": [
        (
            _RESHAPE_AND_CACHE,
            "atb",
            {
                r: _src(r, "op_plugin/ops/atb/ReshapeAndCachAtb.cpp", "m.def, line 56")
                for r in RELEASES
            },
        )
    ],
    "_npu_paged_attention_quant": [
        (
            _PA_QUANT,
            "atb",
            {
                r: _src(r, "op_plugin/ops/atb/Fa3Atb.cpp", "m.def, line 63")
                for r in RELEASES
            },
        )
    ],
}


def _build_calls() -> dict[str, dict[str, CallSpec]]:
    calls: dict[str, dict[str, CallSpec]] = {r: {} for r in RELEASES}
    for name, variants in _SCHEMAS.items():
        for schema, binding, where in variants:
            sig = parse_schema(schema)
            if sig.name != name:
                raise ValueError(f"schema of {name} names {sig.name}")
            for release, cite in where.items():
                calls[release][name] = CallSpec(name, release, sig, binding, cite)
    return calls


#: release -> call name -> :class:`CallSpec`.
CALLS: dict[str, dict[str, CallSpec]] = _build_calls()


def call_spec(release: str, name: str) -> CallSpec | None:
    """The call ``name`` in ``release``, or None when that release lacks it."""
    release_index(release)
    return CALLS[release].get(name)


# -- allowed values --------------------------------------------------------------------
@dataclass(frozen=True)
class OneOf:
    values: tuple

    def __contains__(self, value: object) -> bool:
        return value in self.values

    def describe(self) -> str:
        shown = [_show(v) for v in self.values]
        return shown[0] if len(shown) == 1 else "one of " + ", ".join(shown)


@dataclass(frozen=True)
class Multiple:
    of: int
    hi: int | None = None

    def __contains__(self, value: object) -> bool:
        return (
            isinstance(value, int)
            and value > 0
            and value % self.of == 0
            and (self.hi is None or value <= self.hi)
        )

    def describe(self) -> str:
        tail = f" and <= {self.hi}" if self.hi is not None else ""
        return f"a positive multiple of {self.of}{tail}"


@dataclass(frozen=True)
class PowerOfTwo:
    hi: int

    def __contains__(self, value: object) -> bool:
        return (
            isinstance(value, int) and 0 < value <= self.hi and value & (value - 1) == 0
        )

    def describe(self) -> str:
        return f"a power of two <= {self.hi}"


@dataclass(frozen=True)
class AtMost:
    hi: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and value <= self.hi

    def describe(self) -> str:
        return f"<= {self.hi}"


def _show(value: object) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return repr(value)


# -- spec fields -----------------------------------------------------------------------
def spec_value(spec: AttentionSpec | LinearSpec, name: str) -> object:
    """A field of ``spec`` or a quantity derived from it, by name.

    Derived: ``head_pair`` ``(H, Hkv)``, ``group`` ``H // Hkv``, ``kv_width``
    ``Hkv*D``, ``rope_dim`` (MLA ``Dr``), ``dtypes_match`` (query dtype == cache
    dtype); of a linear spec ``deq_pair`` ``(scale dtype, output dtype)``.
    """
    if name == "deq_pair":
        return (spec.scale_dtype, spec.out_dtype)
    if name == "head_pair":
        return (spec.num_heads, spec.num_kv_heads)
    if name == "group":
        return spec.num_heads // max(spec.num_kv_heads, 1)
    if name == "kv_width":
        return spec.num_kv_heads * spec.head_dim
    if name == "rope_dim":
        return dict(spec.extra).get("rope_dim", 0)
    if name == "dtypes_match":
        return spec.query_dtype == spec.cache_dtype
    return getattr(spec, name)


_FIELD_NAMES = {
    "head_pair": "(num_heads, num_kv_heads)",
    "group": "num_heads // num_kv_heads",
    "kv_width": "Hkv*D",
    "dtypes_match": "query dtype == cache dtype",
    "deq_pair": "(deq_scale dtype, output dtype)",
    "k": "K (x1 last dim)",
    "n": "N (x2 last dim)",
    "scale_exact": "scale and offset exact in the input dtype",
}


# -- routes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """The torch_npu calls that serve one ``(op, mode, layout)``, from ``since``."""

    id: str
    op: str
    modes: tuple[str, ...]
    layout: str
    calls: tuple[str, ...]
    since: str
    cite: tuple[Citation, ...]
    note: str = ""


_FIA = "npu_fused_infer_attention_score"
_FIA2 = "npu_fused_infer_attention_score_v2"
_SCATTER = "npu_scatter_pa_kv_cache"

ROUTES: tuple[Route, ...] = (
    Route(
        "route.cache_write.nz",
        "cache_write",
        ("float", "int8_kv", "faquant"),
        "nz",
        ("npu_quantize", _SCATTER),
        "7.2.0",
        (_doc("7.2.0", _SCATTER, "scenario 1: [NB, N*D // last_dim, BS, last_dim]"),),
        "int8 caches are quantized with npu_quantize first",
    ),
    Route(
        "route.cache_write.nd",
        "cache_write",
        ("float", "int8_kv", "faquant"),
        "nd",
        ("npu_quantize", "_npu_reshape_and_cache"),
        "7.1.0",
        (
            _src(
                "7.1.0",
                "test/test_custom_ops/test_atb_reshape_and_cache.py",
                "ND caches [NB, BS, N, D], line 76",
            ),
        ),
        "ATB ReshapeAndCache picks ND for caches not cast to ACL format 29",
    ),
    Route(
        "route.mla_cache_write.nz",
        "mla_cache_write",
        ("float", "fakquant"),
        "nz",
        ("npu_quantize", _SCATTER),
        "7.2.0",
        (_doc("7.2.0", _SCATTER, "k_head_size and v_head_size may differ"),),
    ),
    Route(
        "route.mla_cache_write.nd",
        "mla_cache_write",
        ("float", "fakquant"),
        "nd",
        ("npu_quantize", "_npu_reshape_and_cache"),
        "7.1.0",
        (
            _src(
                "7.1.0",
                "test/test_custom_ops/test_atb_reshape_and_cache.py",
                "head_size_k != head_size_v, line 62",
            ),
        ),
    ),
    Route(
        "route.decode.float.nd",
        "decode",
        ("float",),
        "nd",
        (_FIA,),
        "7.1.0",
        _docs(
            _FIA,
            {
                "7.1.0": "Q_S = 1, page attention, line 390",
                "26.0.0": "Q_S = 1, page attention, line 365",
            },
        ),
        "float KV is read from the documented ND paged layout [NB, BS, Hkv*D]",
    ),
    Route(
        "route.decode.int8_kv.nz",
        "decode",
        ("int8_kv",),
        "nz",
        (_FIA,),
        "7.2.0",
        _docs(
            _FIA,
            {
                "7.2.0": "GQA antiquant with NZ KV, line 231",
                "26.0.0": "GQA antiquant with NZ KV, line 203",
            },
        ),
        "the 7.1.0 page documents no NZ int8 KV decode",
    ),
    Route(
        "route.decode.faquant.nd",
        "decode",
        ("faquant",),
        "nd",
        ("npu_quantize", "_npu_paged_attention_quant"),
        "7.1.0",
        (
            _src(
                "7.1.0",
                "test/test_custom_ops/test_atb_paged_attention_quant.py",
                "int8 ND caches, quant_type 3, line 521",
            ),
        ),
    ),
    Route(
        "route.mla_decode.nz",
        "mla_decode",
        ("float", "fakquant"),
        "nz",
        (_FIA2,),
        "7.2.0",
        _docs(
            _FIA2,
            {
                "7.2.0": "MLA, query D = 512, line 180",
                "26.0.0": "MLA, query D = 512, line 165",
            },
        ),
        "npu_fused_infer_attention_score_v2 first appears in 7.2.0",
    ),
    # --- W8A8 linears (every release has the three calls) ---------------------------
    Route(
        "route.linear.quantize_static",
        "quantize_static",
        ("static",),
        "nd",
        ("npu_quantize",),
        "7.1.0",
        (_vllm("vllm_ascend/ops/register_custom_ops.py", "_quantize_impl"),),
        "per-tensor activations: npu_quantize(x, 1 / input_scale, input_offset, "
        "qint8, -1, div_mode=False), as vllm-ascend's W8A8 apply calls it",
    ),
    Route(
        "route.linear.dynamic_quant",
        "dynamic_quant",
        ("dynamic",),
        "nd",
        ("npu_dynamic_quant",),
        "7.1.0",
        (_vllm("vllm_ascend/quantization/methods/w8a8_dynamic.py", "apply"),),
    ),
    Route(
        "route.linear.quant_matmul",
        "quant_matmul",
        ("static",),
        "nd",
        ("npu_quant_matmul",),
        "7.1.0",
        (_vllm("vllm_ascend/quantization/methods/w8a8_static.py", "apply"),),
        "int32 quant_bias, deq_scale float32 (bf16 models) or int64 (fp16 models)",
    ),
    Route(
        "route.linear.quant_matmul_dynamic",
        "quant_matmul_dynamic",
        ("dynamic",),
        "nd",
        ("npu_quant_matmul",),
        "7.1.0",
        (_vllm("vllm_ascend/quantization/methods/w8a8_dynamic.py", "apply"),),
        "pertoken_scale from npu_dynamic_quant, float32 weight_scale",
    ),
)


def route_for(spec: AttentionSpec | LinearSpec) -> Route | None:
    """The route serving ``spec`` (any release), or None when nothing maps it."""
    for r in ROUTES:
        if r.op == spec.op and spec.mode in r.modes and r.layout == spec.layout:
            return r
    return None


# -- rules --------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """A documented constraint of one call.

    ``when`` selects the specs the rule applies to (field -> accepted values);
    ``field`` / ``allowed`` is the check. ``kind="argument"`` rules have no spec
    check: they say how the mapping must pass an argument, and the strict fake
    enforces them on the call.
    """

    id: str
    call: str
    text: str
    releases: tuple[str, ...]
    cite: tuple[Citation, ...]
    kind: str = "spec"
    when: tuple[tuple[str, tuple], ...] = ()
    field: str = ""
    allowed: object = None
    issue_rule: int | None = None

    def applies(self, spec: AttentionSpec) -> bool:
        return all(spec_value(spec, f) in vals for f, vals in self.when)


_ALL = RELEASES
_FROM_72 = RELEASES[1:]
_DECODE_INT8 = (("op", ("decode",)), ("mode", ("int8_kv",)), ("layout", ("nz",)))
_DECODE_FLOAT = (("op", ("decode",)), ("mode", ("float",)), ("layout", ("nd",)))
_DECODE_FA = (("op", ("decode",)), ("mode", ("faquant",)), ("layout", ("nd",)))
_MLA = (("op", ("mla_decode",)),)
_DEVICE_OPS = (
    "cache_write",
    "mla_cache_write",
    "decode",
    "mla_decode",
)

_FIA_INT8NZ = {
    "7.2.0": "GQA antiquant with NZ KV, lines 231-244",
    "7.3.0": "GQA antiquant with NZ KV, lines 202-215",
    "26.0.0": "GQA antiquant with NZ KV, lines 203-216",
}
_FIA_PA = {
    "7.1.0": "Q_S = 1, page attention, lines 387-392",
    "7.2.0": "Q_S = 1, page attention, lines 390-395",
    "7.3.0": "Q_S = 1, page attention, lines 361-366",
    "26.0.0": "Q_S = 1, page attention, lines 362-367",
}
_FIA2_MLA = {
    "7.2.0": "MLA, query D = 512, lines 176-190",
    "7.3.0": "MLA, query D = 512, lines 157-169",
    "26.0.0": "MLA, query D = 512, lines 163-175",
}
_SCATTER_CONSTRAINTS = {
    "7.2.0": "constraints, lines 73-76",
    "7.3.0": "constraints, lines 62-65",
    "26.0.0": "constraints, lines 65-68",
}

RULES: tuple[Rule, ...] = (
    # --- every device op -----------------------------------------------------------
    Rule(
        "npu.cache_dtype",
        _FIA,
        "KV caches on the NPU are float16, bfloat16 or int8",
        _ALL,
        _docs(_FIA, {"7.1.0": "key, line 25", "26.0.0": "key, line 34"}),
        when=(("op", _DEVICE_OPS),),
        field="cache_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16, torch.int8)),
    ),
    Rule(
        "npu.fp8_kv",
        _FIA,
        "no FP8 KV cache on the mapped paths: the fused infer attention that reads "
        "every GQA cache takes float16 / bfloat16 / int8 / int4 K/V, no float8 "
        "(Atlas A2 / A3), so an FP8 cache is neither written nor read",
        _ALL,
        _docs(_FIA, {"7.1.0": "key, lines 25-27", "26.0.0": "key, line 34"}),
        when=(("mode", ("fp8_kv",)),),
        field="cache_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16, torch.int8)),
    ),
    Rule(
        "npu.offsets",
        _FIA,
        "the mapped kernels take symmetric scales (offsets must be 0)",
        _ALL,
        _docs(_FIA, {"26.0.0": "GQA antiquant with NZ KV, line 214"}),
        when=(("op", _DEVICE_OPS),),
        field="has_offsets",
        allowed=OneOf((False,)),
    ),
    # --- rule 1 / 5: GQA int8-KV decode over NZ caches --------------------------------
    Rule(
        "fia.int8nz.query_dtype",
        _FIA,
        "int8 NZ antiquant decode takes a bfloat16 query",
        _FROM_72,
        _docs(_FIA, _FIA_INT8NZ),
        when=_DECODE_INT8,
        field="query_dtype",
        allowed=OneOf((torch.bfloat16,)),
        issue_rule=1,
    ),
    Rule(
        "fia.int8nz.head_dim",
        _FIA,
        "int8 NZ antiquant decode supports only D = 128",
        _FROM_72,
        _docs(_FIA, _FIA_INT8NZ),
        when=_DECODE_INT8,
        field="head_dim",
        allowed=OneOf((128,)),
        issue_rule=1,
    ),
    Rule(
        "fia.int8nz.block_size",
        _FIA,
        "int8 NZ antiquant decode supports block size 128 or 512",
        _FROM_72,
        _docs(_FIA, _FIA_INT8NZ),
        when=_DECODE_INT8,
        field="block_size",
        allowed=OneOf((128, 512)),
        issue_rule=1,
    ),
    Rule(
        "fia.int8nz.heads",
        _FIA,
        "int8 NZ antiquant decode supports only these (query heads, KV heads)",
        _FROM_72,
        _docs(_FIA, _FIA_INT8NZ),
        when=_DECODE_INT8,
        field="head_pair",
        allowed=OneOf(FIA_INT8_NZ_HEAD_PAIRS),
        issue_rule=5,
    ),
    Rule(
        "fia.int8nz.antiquant_scale",
        _FIA,
        "per-channel key/value_antiquant_scale: bfloat16, contiguous, [Hkv, 1, D] "
        "for BNSD, key/value_antiquant_mode 0, no antiquant offsets",
        _FROM_72,
        _docs(_FIA, _FIA_INT8NZ)
        + (_vllm("vllm_ascend/attention/attention_v1.py", "_prepare_c8_scales"),),
        kind="argument",
        issue_rule=1,
    ),
    Rule(
        "fia.int8nz.kv_layout",
        _FIA,
        "int8 key/value are NZ [NB, Hkv, D // 32, BS, 32]",
        _FROM_72,
        _docs(_FIA, _FIA_INT8NZ)
        + (_vllm("vllm_ascend/attention/attention_v1.py", "_nz_5d_view"),),
        kind="argument",
        issue_rule=1,
    ),
    Rule(
        "fia.int8nz.inner_precise",
        _FIA,
        "int8 NZ antiquant decode supports only high-performance mode "
        "(inner_precise = 1; 0 is high precision)",
        _FROM_72,
        _docs(_FIA, _FIA_INT8NZ),
        kind="argument",
        issue_rule=8,
    ),
    # --- rule 6: float decode, ND paged layout ---------------------------------------
    Rule(
        "fia.pa.query_dtype",
        _FIA,
        "paged decode takes a float16 or bfloat16 query",
        _ALL,
        _docs(_FIA, {"7.1.0": "query, line 21", "26.0.0": "query, line 32"}),
        when=_DECODE_FLOAT,
        field="query_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16)),
        issue_rule=6,
    ),
    Rule(
        "fia.pa.dtypes_match",
        _FIA,
        "float paged decode reads K/V of the query's dtype",
        _ALL,
        _docs(_FIA, _FIA_PA),
        when=_DECODE_FLOAT,
        field="dtypes_match",
        allowed=OneOf((True,)),
        issue_rule=6,
    ),
    Rule(
        "fia.pa.block_size",
        _FIA,
        "paged decode: float16/bfloat16 KV block size 16-aligned",
        ("7.1.0",),
        _docs(_FIA, {"7.1.0": _FIA_PA["7.1.0"]}),
        when=_DECODE_FLOAT,
        field="block_size",
        allowed=Multiple(16),
        issue_rule=6,
    ),
    Rule(
        "fia.pa.block_size",
        _FIA,
        "paged decode: float16/bfloat16 KV block size 16-aligned and at most 512",
        _FROM_72,
        _docs(_FIA, {r: _FIA_PA[r] for r in _FROM_72}),
        when=_DECODE_FLOAT,
        field="block_size",
        allowed=Multiple(16, 512),
        issue_rule=6,
    ),
    Rule(
        "fia.pa.kv_width",
        _FIA,
        "paged KV as [NB, BS, H]: Hkv*D must not exceed 65535",
        _ALL,
        _docs(_FIA, _FIA_PA),
        when=_DECODE_FLOAT,
        field="kv_width",
        allowed=AtMost(65535),
        issue_rule=6,
    ),
    Rule(
        "fia.pa.head_dim",
        _FIA,
        "Q_S = 1 decode supports D <= 512",
        _ALL,
        _docs(_FIA, {"7.1.0": "Q_S = 1, line 368", "26.0.0": "Q_S = 1, line 343"}),
        when=_DECODE_FLOAT,
        field="head_dim",
        allowed=AtMost(512),
        issue_rule=6,
    ),
    Rule(
        "fia.heads",
        _FIA,
        "Q_S = 1 decode supports N <= 256",
        _ALL,
        _docs(_FIA, {"7.1.0": "Q_S = 1, line 368", "26.0.0": "Q_S = 1, line 343"}),
        when=(("op", ("decode",)), ("mode", ("float", "int8_kv"))),
        field="num_heads",
        allowed=AtMost(256),
    ),
    Rule(
        "fia.group",
        _FIA,
        "num_heads / num_key_value_heads must not exceed 64",
        _ALL,
        _docs(
            _FIA,
            {
                "7.1.0": "num_key_value_heads, line 115",
                "26.0.0": "num_key_value_heads, line 88",
            },
        ),
        when=(("op", ("decode",)), ("mode", ("float", "int8_kv"))),
        field="group",
        allowed=AtMost(64),
    ),
    Rule(
        "fia.pa.kv_layout",
        _FIA,
        "float paged K/V are ND [NB, BS, Hkv*D] (or [NB, Hkv, BS, D]); float KV in "
        "NZ is not a documented v1 configuration",
        _ALL,
        _docs(_FIA, _FIA_PA),
        kind="argument",
        issue_rule=6,
    ),
    Rule(
        "fia.inner_precise",
        _FIA,
        "Q_S = 1 takes inner_precise 0 (high precision) or 1 (high performance)",
        _ALL,
        _docs(
            _FIA,
            {
                "7.1.0": "inner_precise, lines 125-130",
                "7.2.0": "inner_precise, lines 111-116",
                "7.3.0": "inner_precise, lines 96-101",
                "26.0.0": "inner_precise, lines 97-102",
            },
        ),
        kind="argument",
        issue_rule=8,
    ),
    Rule(
        "fia.paged_args",
        _FIA,
        "BNSD query [B, N, 1, D], num_heads = N, num_key_value_heads = KV N, "
        "block_table int32 [B, >= blocks], actual_seq_lengths_kv one int per batch",
        _ALL,
        _docs(_FIA, _FIA_PA),
        kind="argument",
    ),
    # --- rule 7: FAQuant through ATB --------------------------------------------------
    Rule(
        "atb.pa_quant.out_dtype",
        "_npu_paged_attention_quant",
        "outdata_type is 1 (float16) or 27 (bfloat16): the query dtype",
        _ALL,
        (
            _src(
                "7.1.0",
                "test/test_custom_ops/test_atb_paged_attention_quant.py",
                "outdata_type 27, line 521",
            ),
        ),
        when=_DECODE_FA,
        field="query_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16)),
        issue_rule=7,
    ),
    Rule(
        "atb.pa_quant.context_lens",
        "_npu_paged_attention_quant",
        "context_lens is a host (CPU) int32 tensor",
        _ALL,
        tuple(
            _src(
                r,
                "test/test_custom_ops/test_atb_paged_attention_quant.py",
                "contex_lens_t kept on the host, lines 508-532",
            )
            for r in ("7.1.0", "26.0.0")
        ),
        kind="argument",
        issue_rule=7,
    ),
    Rule(
        "atb.pa_quant.args",
        "_npu_paged_attention_quant",
        "int8 query [T, N, D], int8 ND caches [NB, BS, Hkv, D], device int32 "
        "block_table, quant_type 3, fp32 k_descale / v_descale [N], out [T, N, D] "
        "of the outdata_type",
        _ALL,
        tuple(
            _src(
                r,
                "test/test_custom_ops/test_atb_paged_attention_quant.py",
                "calc_data and the call, lines 380-532",
            )
            for r in ("7.1.0", "26.0.0")
        ),
        kind="argument",
        issue_rule=7,
    ),
    # --- rule 2 / 3 / 4: cache writes -------------------------------------------------
    Rule(
        "scatter.dtypes",
        _SCATTER,
        "key, value, key_cache and value_cache share one dtype",
        _FROM_72,
        _docs(_SCATTER, _SCATTER_CONSTRAINTS),
        kind="argument",
        issue_rule=2,
    ),
    Rule(
        "scatter.nz_shape",
        _SCATTER,
        "NZ caches [NB, N*D // last_dim, BS, last_dim] with last_dim = 32 bytes "
        "(16 for float16/bfloat16, 32 for int8); key [T, N, D]; contiguous inputs",
        _FROM_72,
        _docs(_SCATTER, {"7.2.0": "scenario 1", "26.0.0": "scenario 1"})
        + (
            _src(
                "26.0.0",
                "test/test_custom_ops/test_scatter_pa_kv_cache.py",
                "lastDim_k",
            ),
        ),
        kind="argument",
        issue_rule=2,
    ),
    Rule(
        "scatter.cache_mode",
        _SCATTER,
        "cache_mode is a keyword from 26.0.0 only ('PA_NZ' NZ, 'Norm' ND); 7.2.0 "
        "and 7.3.0 always write PA_NZ",
        _FROM_72,
        (
            _doc("26.0.0", _SCATTER, "cache_mode, line 57"),
            _src("7.3.0", "op_plugin/ops/opapi/ScatterPaKvCacheNpuOpApi.cpp", "PA_NZ"),
        ),
        kind="argument",
        issue_rule=2,
    ),
    Rule(
        "cache.slots",
        _SCATTER,
        "slot_mapping in [0, NB*BS - 1], no repeats: padding slots (-1) are "
        "filtered on the host side before the call",
        _ALL,
        _docs(_SCATTER, _SCATTER_CONSTRAINTS),
        kind="argument",
        issue_rule=4,
    ),
    Rule(
        "atb.reshape_and_cache.nd",
        "_npu_reshape_and_cache",
        "ND caches [NB, BS, N, D] (not cast to ACL format 29), int32 slot_indices, "
        "key / key_cache and value / value_cache of one dtype",
        _ALL,
        tuple(
            _src(
                r,
                "test/test_custom_ops/test_atb_reshape_and_cache.py",
                "test_reshape_and_cache, lines 59-79",
            )
            for r in ("7.1.0", "26.0.0")
        ),
        kind="argument",
        issue_rule=2,
    ),
    Rule(
        "cache.mla_no_mixed_dtypes",
        _SCATTER,
        "MLA writes never pass the int8 latent and the bfloat16 rope in one "
        "mixed-dtype call: each call's operands agree in dtype",
        _ALL,
        _docs(_SCATTER, _SCATTER_CONSTRAINTS)
        + (_vllm("vllm_ascend/attention/mla_v1.py", "npu_kv_rmsnorm_rope_cache"),),
        kind="argument",
        issue_rule=3,
    ),
    Rule(
        "quantize.args",
        "npu_quantize",
        "div_mode=True (cache writes: symmetric per channel): float16/bfloat16/"
        "float32 input, float32 scales [input.shape[axis]], zero_points None (or "
        "int32 of the scales' shape for an integer offset), dtype qint8",
        _ALL,
        _docs(
            "npu_quantize",
            {
                "7.1.0": "parameters, lines 7-45",
                "7.2.0": "parameters, lines 16-55",
                "26.0.0": "parameters, lines 17-56",
            },
        ),
        kind="argument",
        issue_rule=2,
    ),
    # --- rule 5 (MLA): FAKQuant through the v2 fused attention ------------------------
    Rule(
        "fia2.mla.heads",
        _FIA2,
        "MLA (query D = 512 with rope) needs query heads N in 1/2/4/.../128",
        _FROM_72,
        _docs(_FIA2, _FIA2_MLA),
        when=_MLA,
        field="num_heads",
        allowed=PowerOfTwo(128),
        issue_rule=5,
    ),
    Rule(
        "fia2.mla.latent_dim",
        _FIA2,
        "MLA key D (latent width R) is 512",
        _FROM_72,
        _docs(_FIA2, _FIA2_MLA),
        when=_MLA,
        field="head_dim",
        allowed=OneOf((512,)),
    ),
    Rule(
        "fia2.mla.rope_dim",
        _FIA2,
        "MLA query_rope / key_rope D (Dr) is 64",
        _FROM_72,
        _docs(_FIA2, _FIA2_MLA),
        when=_MLA,
        field="rope_dim",
        allowed=OneOf((64,)),
    ),
    Rule(
        "fia2.mla.block_size",
        _FIA2,
        "MLA with NZ KV: block_size 128 (16 is not allowed in NZ)",
        ("7.2.0",),
        _docs(_FIA2, {"7.2.0": "MLA, query D = 512, line 184"}),
        when=_MLA,
        field="block_size",
        allowed=OneOf((128,)),
    ),
    Rule(
        "fia2.mla.block_size",
        _FIA2,
        "MLA page attention: block_size a multiple of 16, at most 1024",
        ("7.3.0", "26.0.0"),
        _docs(
            _FIA2,
            {"7.3.0": "MLA, query D = 512, line 163", "26.0.0": "MLA, line 169"},
        ),
        when=_MLA,
        field="block_size",
        allowed=Multiple(16, 1024),
    ),
    Rule(
        "fia2.mla.query_dtype",
        _FIA2,
        "FAKQuant: int8 query with bfloat16 query_rope / key_rope, bfloat16 output",
        _FROM_72,
        _docs(_FIA2, _FIA2_MLA),
        when=(("op", ("mla_decode",)), ("mode", ("fakquant",))),
        field="query_dtype",
        allowed=OneOf((torch.bfloat16,)),
    ),
    Rule(
        "fia2.mla.float_dtype",
        _FIA2,
        "MLA query and query_rope are float16 or bfloat16",
        _FROM_72,
        _docs(_FIA2, _FIA2_MLA),
        when=(("op", ("mla_decode",)), ("mode", ("float",))),
        field="query_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16)),
    ),
    Rule(
        "fia2.mla.quant_args",
        _FIA2,
        "FAKQuant: query_quant_mode 3 with float32 dequant_scale_query [B, 1, N]; "
        "key/value_quant_mode 0 (per-tensor) with float32 dequant_scale_key / "
        "dequant_scale_value; no offsets",
        _FROM_72,
        _docs(_FIA2, _FIA2_MLA)
        + (_vllm("vllm_ascend/attention/mla_v1.py", "extra_fa_args"),),
        kind="argument",
        issue_rule=5,
    ),
    Rule(
        "fia2.mla.layout",
        _FIA2,
        "input_layout BSND_NBSD: query [B, 1, N, 512], query_rope [B, 1, N, 64], "
        "key = value the latent NZ [NB, 1, 512 // C0, BS, C0], key_rope NZ "
        "[NB, 1, 64 // 16, BS, 16]",
        _FROM_72,
        _docs(_FIA2, _FIA2_MLA)
        + (_vllm("vllm_ascend/attention/mla_v1.py", "_forward_decode"),),
        kind="argument",
    ),
)


_QMM = "npu_quant_matmul"
_MATMULS = ("quant_matmul", "quant_matmul_dynamic")
#: npu_quant_matmul page, the A2/A3 table of supported dtype combinations.
_QMM_TABLE = {
    "7.1.0": "table 2 (Atlas A2), line 137",
    "7.2.0": "table 2 (Atlas A2/A3), lines 114-124",
    "7.3.0": "table 2 (Atlas A2/A3), lines 106-116",
    "26.0.0": "table 2 (Atlas A2/A3), lines 108-118",
}
_QMM_LAST_DIM = {
    "7.1.0": "constraints, line 68",
    "7.2.0": "constraints, line 91",
    "7.3.0": "constraints, line 83",
    "26.0.0": "constraints, line 84",
}
_QUANTIZE_MUL = {
    "7.1.0": "scales / zero_points with div_mode False, lines 32-44",
    "7.2.0": "scales / zero_points with div_mode False, lines 42-54",
    "7.3.0": "scales / zero_points with div_mode False, lines 43-54",
    "26.0.0": "scales / zero_points with div_mode False, lines 43-54",
}

LINEAR_RULES: tuple[Rule, ...] = (
    Rule(
        "quantize.static.input_dtype",
        "npu_quantize",
        "npu_quantize takes a float16, bfloat16 or float32 input",
        _ALL,
        _docs(
            "npu_quantize",
            {
                "7.1.0": "input, lines 23-25",
                "7.2.0": "input, lines 33-35",
                "7.3.0": "input, lines 34-36",
                "26.0.0": "input, lines 34-36",
            },
        ),
        when=(("op", ("quantize_static",)),),
        field="input_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16, torch.float32)),
    ),
    Rule(
        "quantize.mul_mode.scale_dtype",
        "npu_quantize",
        "with div_mode=False scales and zero_points have the input's dtype (so the "
        "float32 scale and offset must be exact in it: a cast would change the "
        "codes); with div_mode=True the offset is an integer (int32 zero_points)",
        _ALL,
        _docs("npu_quantize", _QUANTIZE_MUL),
        when=(("op", ("quantize_static",)),),
        field="scale_exact",
        allowed=OneOf((True,)),
    ),
    Rule(
        "quantize.mul_mode",
        "npu_quantize",
        "div_mode=False: scales 1-D with input.shape[axis] (or 1) entries, "
        "zero_points None or of the scales' shape and dtype, dtype qint8, "
        "axis >= -2; the mapping passes [K] vectors and axis -1 as vllm-ascend does",
        _ALL,
        _docs("npu_quantize", _QUANTIZE_MUL)
        + (_vllm("vllm_ascend/quantization/methods/w8a8_static.py", "aclnn_input"),),
        kind="argument",
    ),
    Rule(
        "dynamic_quant.input_dtype",
        "npu_dynamic_quant",
        "npu_dynamic_quant takes a float16 or bfloat16 input",
        _ALL,
        _docs(
            "npu_dynamic_quant",
            {
                "7.1.0": "x, line 28",
                "7.2.0": "x, line 38",
                "7.3.0": "x, line 38",
                "26.0.0": "x, line 38",
            },
        ),
        when=(("op", ("dynamic_quant",)),),
        field="input_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16)),
    ),
    Rule(
        "dynamic_quant.args",
        "npu_dynamic_quant",
        "x at least 2-D; no smooth_scales / group_index; dst_type None (int8): "
        "returns int8 y of x's shape and float32 scale of x.shape[:-1]",
        _ALL,
        _docs(
            "npu_dynamic_quant",
            {"7.1.0": "parameters, lines 28-39", "26.0.0": "parameters, lines 38-50"},
        ),
        kind="argument",
    ),
    Rule(
        "qmm.out_dtype",
        _QMM,
        "npu_quant_matmul's float outputs are float16 and bfloat16 (no float32)",
        _ALL,
        _docs(_QMM, _QMM_TABLE),
        when=(("op", _MATMULS),),
        field="out_dtype",
        allowed=OneOf((torch.float16, torch.bfloat16)),
    ),
    Rule(
        "qmm.k",
        _QMM,
        "the last dims of x1 (K) and x2 (N) must not exceed 65535",
        _ALL,
        _docs(_QMM, _QMM_LAST_DIM),
        when=(("op", _MATMULS),),
        field="k",
        allowed=AtMost(65535),
    ),
    Rule(
        "qmm.n",
        _QMM,
        "the last dims of x1 (K) and x2 (N) must not exceed 65535",
        _ALL,
        _docs(_QMM, _QMM_LAST_DIM),
        when=(("op", _MATMULS),),
        field="n",
        allowed=AtMost(65535),
    ),
    Rule(
        "qmm.deq_scale",
        _QMM,
        "without pertoken_scale: an int64 scale only with a float16 output, a "
        "float32 scale with float16 or bfloat16",
        _ALL,
        _docs(_QMM, _QMM_TABLE),
        when=(("op", ("quant_matmul",)),),
        field="deq_pair",
        allowed=OneOf(
            (
                (torch.int64, torch.float16),
                (torch.float32, torch.float16),
                (torch.float32, torch.bfloat16),
            )
        ),
    ),
    Rule(
        "qmm.args",
        _QMM,
        "x1 int8 [M, K], x2 int8 [K, N] contiguous (the checkpoint's [N, K] "
        "transposed, as vllm-ascend stores it), scale 1-D [N], no offset; static: "
        "int32 bias [N] or None, no pertoken_scale; dynamic: float32 "
        "pertoken_scale [M], float32 scale, float32 bias [N] or None",
        _ALL,
        _docs(_QMM, _QMM_TABLE)
        + (
            _vllm(
                "vllm_ascend/quantization/methods/w8a8_static.py",
                "process_weights_after_loading: weight.transpose(0, 1).contiguous()",
            ),
        ),
        kind="argument",
    ),
)

RULES = RULES + LINEAR_RULES


def rules_for(release: str, *, kind: str | None = None) -> tuple[Rule, ...]:
    """The rules holding in ``release`` (of one ``kind`` when given)."""
    release_index(release)
    return tuple(
        r for r in RULES if release in r.releases and (kind is None or r.kind == kind)
    )


def rule(rule_id: str, release: str = DEFAULT_RELEASE) -> Rule:
    """The rule ``rule_id`` as it holds in ``release``."""
    for r in rules_for(release):
        if r.id == rule_id:
            return r
    raise KeyError(f"no rule {rule_id!r} in torch_npu {release}")


def _reason(r: Rule, value: object, release: str) -> str:
    cite = next((c for c in r.cite if c.commit == OP_PLUGIN_COMMITS[release]), None)
    cite = cite or r.cite[0]
    name = _FIELD_NAMES.get(r.field, r.field)
    return (
        f"[{r.id}] {r.text}: {name} = {_show(value)}, allowed "
        f"{r.allowed.describe()} (torch_npu {release}; {cite})"
    )


def _route_reasons(spec: AttentionSpec | LinearSpec, release: str) -> list[str]:
    route = route_for(spec)
    if route is None:
        served = [f"{r.layout} {'/'.join(r.modes)}" for r in ROUTES if r.op == spec.op]
        if not served:
            return [
                f"[route] {spec.op} is not mapped to a torch_npu kernel by the npu "
                f"backend (torch_npu {release}); the cpu/cuda emulation serves it"
            ]
        return [
            f"[route] no documented torch_npu call serves {spec.op} with mode "
            f"{spec.mode!r} over a {spec.layout!r} cache (torch_npu {release}); "
            f"mapped: {'; '.join(served)}"
        ]
    reasons = []
    if release_index(release) < release_index(route.since):
        reasons.append(
            f"[{route.id}] {spec.op} ({spec.mode}, {spec.layout} cache) through "
            f"{' + '.join(route.calls)} is documented from torch_npu "
            f"{route.since}, not in torch_npu {release} ({route.cite[0]})"
        )
    for call in route.calls:
        if call not in CALLS[release] and not reasons:
            reasons.append(
                f"[{route.id}] torch_npu {release} has no {call} "
                f"({Citation(OP_PLUGIN, _YAML, OP_PLUGIN_COMMITS[release])})"
            )
    return reasons


@functools.lru_cache(maxsize=1024)
def _cached_reasons(spec: AttentionSpec | LinearSpec, release: str) -> tuple[str, ...]:
    reasons = _route_reasons(spec, release)
    for r in rules_for(release, kind="spec"):
        if r.applies(spec):
            value = spec_value(spec, r.field)
            if value not in r.allowed:
                reasons.append(_reason(r, value, release))
    return tuple(reasons)


def unsupported_reasons(spec: AttentionSpec | LinearSpec, release: str) -> list[str]:
    """Every reason torch_npu ``release`` cannot run ``spec``, from the table.

    Each names the rule (``[id]``), the offending value, what is allowed, the
    release and a citation. Cached per ``(spec, release)``.
    """
    release_index(release)
    return list(_cached_reasons(spec, release))
