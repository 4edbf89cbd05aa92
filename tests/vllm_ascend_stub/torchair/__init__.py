"""A STAND-IN for torchair (torch_npu's graph compiler) on vllm-ascend's
weight-loading path. It is not torchair and compiles nothing.

vllm-ascend 0.18's worker patches (``patch_npugraph_ex_triton``) import torchair,
replace ``core._concrete_graph.ValuePack`` and two ``npu_fx_compiler`` helpers,
and reload ``fx_summary`` / ``npu_fx_compiler``; nothing on the loading path
compiles a graph (the test runs eager). The modules here hold exactly the names
that patch reads or replaces; a helper called raises :class:`StandInError`.
"""


class StandInError(RuntimeError):
    """A torchair function was called on the loading path."""


def refused(name: str):
    def fn(*args, **kwargs):
        raise StandInError(f"torchair stand-in: {name} was called")

    fn.__name__ = fn.__qualname__ = name.rpartition(".")[2]
    return fn


from . import core, fx_summary, npu_fx_compiler  # noqa: E402

__all__ = ["StandInError", "core", "fx_summary", "npu_fx_compiler", "refused"]
