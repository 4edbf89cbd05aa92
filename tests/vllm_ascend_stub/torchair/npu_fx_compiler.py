"""``torchair.npu_fx_compiler`` of the stand-in: the names vllm-ascend's patch
imports or replaces."""

from torchair import refused
from torchair.core._concrete_graph import ValuePack  # noqa: F401

_unpack_meta_list = refused("torchair.npu_fx_compiler._unpack_meta_list")
_unpack_meta = refused("torchair.npu_fx_compiler._unpack_meta")


class _NpuGraphConverter:
    """Its ``_unpack_npu`` is replaced by vllm-ascend's patch."""

    _unpack_npu = staticmethod(refused("torchair.npu_fx_compiler._unpack_npu"))
