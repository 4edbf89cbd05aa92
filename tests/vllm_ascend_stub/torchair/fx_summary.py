"""``torchair.fx_summary`` of the stand-in: reloaded by vllm-ascend's patch."""

from torchair.core._concrete_graph import ValuePack  # noqa: F401
