"""``torchair.core._concrete_graph`` of the stand-in: the names vllm-ascend's
patch imports or replaces."""

from torchair import refused

_is_symlist = refused("torchair.core._concrete_graph._is_symlist")


class ValuePack:
    """Replaced by vllm-ascend's own ``ValuePack`` when its patch runs."""
