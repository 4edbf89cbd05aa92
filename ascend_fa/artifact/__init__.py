"""Ascend-format artifacts: the format (:mod:`.format`), writing (:mod:`.writer`),
reading (:mod:`.reader`) and validation (:mod:`.inspect`).

Every rule about names, shapes and the description lives in :mod:`.format`; the
other modules only apply it.
"""

from __future__ import annotations

from .format import (
    CONFIG_FILE,
    DESCRIPTION_FILE,
    DESCRIPTION_VERSION,
    FA_BRANCHES,
    FA_KINDS,
    FA_QUANT_TYPES,
    FA_TENSOR,
    FA_WEIGHTS_NAME,
    LEGACY_WEIGHTS_NAME,
    META_KEYS,
    REPORT_FILE,
    TOKENIZER_FILES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    ScaleMap,
    disk_scale,
    fa_tensor_name,
    is_meta_key,
    per_head_vector,
)
from .inspect import inspect_artifact, natural_key
from .reader import read_fa_scales, read_tensor_index, weight_files
from .writer import (
    atomic_output_dir,
    build_description,
    checkpoint_state_dict,
    export_artifact,
    fa_tensors,
    merge_into,
    parse_size,
    write_json,
)

__all__ = [
    "CONFIG_FILE",
    "DESCRIPTION_FILE",
    "DESCRIPTION_VERSION",
    "FA_BRANCHES",
    "FA_KINDS",
    "FA_QUANT_TYPES",
    "FA_TENSOR",
    "FA_WEIGHTS_NAME",
    "LEGACY_WEIGHTS_NAME",
    "META_KEYS",
    "REPORT_FILE",
    "TOKENIZER_FILES",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "ScaleMap",
    "atomic_output_dir",
    "build_description",
    "checkpoint_state_dict",
    "disk_scale",
    "export_artifact",
    "fa_tensor_name",
    "fa_tensors",
    "inspect_artifact",
    "is_meta_key",
    "merge_into",
    "natural_key",
    "parse_size",
    "per_head_vector",
    "read_fa_scales",
    "read_tensor_index",
    "weight_files",
    "write_json",
]
