"""Tensor parallelism of the vLLM plugin: which part of a per-head or per-row
tensor this rank holds (imported only inside vLLM).

vLLM splits a model over ``N`` tensor-parallel ranks (one worker process per
rank on its CPU platform) the way its layers load their weights:

==========================  ==============================  =====================
tensor (single worker)      rank ``r`` holds                split by
==========================  ==============================  =====================
column-parallel linear      rows ``r*N_out/N ..``; for the  vLLM's weight loader
(``qkv_proj``, ``gate_up``) ``k`` / ``v`` shards of         (``output_dim=0``)
``weight``, ``deq_scale``,  ``qkv_proj`` the KV heads of
``quant_bias``,             rank ``r`` (below)
``weight_scale``
row-parallel linear         ``weight`` columns              vLLM's weight loader
(``o_proj``, ``down``)      ``r*K/N ..``; ``deq_scale``,    (``input_dim=1``)
                            ``quant_bias``,
                            ``weight_scale`` whole
FAQuant ``fa_q`` ``[H]``    heads ``r*H/N ..``              :func:`head_slice`
``fa_k`` / ``fa_v``,        KV heads of rank ``r``:         :func:`head_slice`
C8 ``k`` / ``v``            ``r*Hkv/N ..``, or head
``[Hkv(, D)]``              ``r // (N/Hkv)`` replicated
                            where ``Hkv < N``
==========================  ==============================  =====================

A row-parallel layer's outputs are summed over the ranks. On the device each
rank applies its W8A8 epilogue to its partial product (vllm-ascend adds
``quant_bias``, the folded float bias and the input offset's correction, on TP
rank 0 only: ``vllm_ascend/quantization/methods/w8a8_static.py``) and the bf16
outputs are summed. The plugin sums the ranks' int32 accumulators instead (exact
in any order) and applies the epilogue, ``quant_bias`` included, once
(:func:`ascend_fa.serving.linear._row_parallel_static`), so a W8A8 row-parallel
linear gives the single worker's output bit for bit; a FLOAT row-parallel linear
sums fp32 partials before one rounding
(:func:`ascend_fa.serving.linear.row_parallel_float`). A W8A8_DYNAMIC
row-parallel linear quantizes its input per token over the rank's slice of the
features (the device's ``npu_dynamic_quant`` on the rank's input), so its codes
are not the single worker's. W8A8_DYNAMIC MoE experts and FAKQuant (MLA)
attention are refused under tensor parallelism (one line at start-up).
"""

from __future__ import annotations

__all__ = ["head_slice", "tp_rank_size"]


def tp_rank_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the number of ranks (0, 1 where
    vLLM's distributed state is not initialized)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def head_slice(total: int, rank: int, size: int, what: str) -> slice:
    """The heads of ``total`` that rank ``rank`` of ``size`` holds, as vLLM's
    ``QKVParallelLinear`` splits them: ``total / size`` consecutive heads each,
    or, where ``total < size``, head ``rank // (size / total)`` replicated. A
    count that splits neither way raises ``ValueError`` (one line naming
    ``what``)."""
    if total >= size:
        if total % size:
            raise ValueError(
                f"{what}: {total} heads do not split over tensor-parallel size "
                f"{size} (a multiple of it is needed)"
            )
        n = total // size
        return slice(rank * n, (rank + 1) * n)
    if size % total:
        raise ValueError(
            f"{what}: {total} heads cannot be replicated over tensor-parallel "
            f"size {size} (it must be a multiple of {total})"
        )
    h = rank // (size // total)
    return slice(h, h + 1)
