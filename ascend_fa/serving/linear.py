"""vLLM linear methods running ascend-fa's W8A8 / W8A8_DYNAMIC linears.

Imported only by :mod:`ascend_fa.serving.vllm_config` (inside vLLM). The
parameters are the artifact's tensors under their names, dtypes and shapes
(:mod:`ascend_fa.linear.modules`); after loading, each layer holds the module
:class:`~ascend_fa.linear.modules.W8A8Linear` / :class:`~ascend_fa.linear.modules.
W8A8DynamicLinear` built from them (``from_tensors``), and ``apply`` is that
module's forward: the device's integer path, not a copy of it.

A fused vLLM layer (``qkv_proj``: ``[q; k; v]`` rows) is one module over the
concatenated rows: ``deq_scale``, ``quant_bias`` and ``weight_scale`` are per row,
so the rows' outputs are those of the shards; the static activation scale is per
tensor, so the shards must carry the same ``input_scale`` / ``input_offset``
(MindIE and vllm-ascend also quantize a fused input once; ascend-fa exports one
value for all shards).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from ascend_fa.atb_ops.linear import int_gemm, static_dequant
from ascend_fa.linear.modules import W8A8DynamicLinear, W8A8Linear

__all__ = [
    "AscendW8A8DynamicLinearMethod",
    "AscendW8A8LinearMethod",
    "row_parallel_float",
]

_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


def _checked_loader(name: str, param: torch.nn.Parameter, inner: Callable) -> Callable:
    """``inner`` behind a dtype check: an int8 tensor must load as int8, a float
    one as float (the description and the tensor must agree)."""
    want_int = not param.dtype.is_floating_point

    def load(p, loaded, *args, **kwargs):
        if (not loaded.dtype.is_floating_point) != want_int:
            raise ValueError(
                f"{name}: the description's type needs {param.dtype} here, the "
                f"checkpoint holds {loaded.dtype}"
            )
        return inner(p, loaded, *args, **kwargs)

    return load


def _per_shard_loader(name: str, shards: int) -> Callable:
    """Loader of a per-tensor value ``[1]`` of each shard into ``[shards]``."""

    def load(param, loaded, shard_id=None):
        if shard_id is None:
            shard_id = getattr(loaded, "shard_id", None)
        i = _SHARD_INDEX.get(shard_id, shard_id) if shard_id is not None else 0
        if loaded.numel() != 1:
            raise ValueError(
                f"{name}: expected one value per linear, the checkpoint holds "
                f"{list(loaded.shape)}"
            )
        param.data[int(i)] = loaded.reshape(-1)[0].to(param.dtype)

    return load


def _add(layer, name: str, tensor: torch.Tensor, loader: Callable, **attrs) -> None:
    param = torch.nn.Parameter(tensor, requires_grad=False)
    prefix = getattr(layer, "prefix", "") or "linear"
    layer.register_parameter(name, param)
    set_weight_attrs(param, attrs)
    param.weight_loader = _checked_loader(f"{prefix}.{name}", param, loader)


def _row_parallel_group(layer):
    """The process group (gloo, CPU) of a row-parallel ``layer`` split over
    more than one TP rank and reduced by vLLM; None for any other layer."""
    from vllm.distributed import get_tp_group
    from vllm.model_executor.layers.linear import RowParallelLinear

    if not isinstance(layer, RowParallelLinear) or layer.tp_size == 1:
        return None
    if not layer.reduce_results:
        return None  # summed by its caller: not the plain all-reduce below
    return get_tp_group().cpu_group


def row_parallel_float(method):
    """vLLM's ``UnquantizedLinearMethod`` instance ``method`` (a FLOAT linear of
    the artifact) with, on a row-parallel layer split over TP ranks, the single
    worker's rounding: each rank's fp32 partial product (bf16 operands: every
    product exact in fp32), summed in fp32 over the ranks, the bias added and the
    sum rounded to the model dtype once; rank 0 returns it and the others zeros
    (:func:`_row_parallel_static`). vLLM's own path rounds each rank's partial to
    bf16 and sums the bf16 values, whose rounding a downstream static activation
    quantization turns into other int8 codes. Elsewhere ``method`` is unchanged;
    its class stays (vLLM picks weight loaders by the method's class name)."""
    after = method.process_weights_after_loading
    apply = method.apply

    def process_weights_after_loading(layer) -> None:
        if _row_parallel_group(layer) is None:
            return after(layer)
        layer.ascend_weight32 = layer.weight.data.float()
        return None

    def apply_tp(layer, x: torch.Tensor, bias: torch.Tensor | None = None):
        group = _row_parallel_group(layer)
        if group is None:
            return apply(layer, x, bias)
        y = torch.nn.functional.linear(x.float(), layer.ascend_weight32)
        torch.distributed.all_reduce(y, group=group)
        # vLLM hands the bias to rank 0 only; the sum gets it once, on every rank
        if layer.bias is not None and not layer.skip_bias_add:
            y = y + layer.bias.float()
        y = y.to(x.dtype)
        return y if layer.tp_rank == 0 else torch.zeros_like(y)

    method.process_weights_after_loading = process_weights_after_loading
    method.apply = apply_tp
    return method


def _row_parallel_static(
    lin: W8A8Linear, x: torch.Tensor, group, rank: int
) -> torch.Tensor:
    """A row-parallel W8A8 linear with the single worker's numerics, bit for
    bit: each rank's int32 accumulator over its slice of ``K`` (codes of its
    slice of ``x`` ``[..., K/N]``, one static scale for all), summed exactly over
    the ranks, then the epilogue ``(acc + quant_bias) * deq_scale`` once. Rank 0
    returns it and the others zeros, so vLLM's all-reduce of the outputs leaves
    it unchanged (``y + 0 == y``). On the device each rank applies its epilogue
    (``quant_bias`` on rank 0 only, vllm-ascend) and the bf16 outputs are
    summed; summing the integers instead keeps TP's outputs those of one
    worker, as the integer product is exact in any order."""
    q = lin.quantize_input(x)
    acc = int_gemm(q, lin.weight)
    torch.distributed.all_reduce(acc, group=group)
    y = static_dequant(acc, lin.deq_scale, lin.quant_bias, x.dtype)
    y = y.view(*x.shape[:-1], lin.out_features)
    return y if rank == 0 else torch.zeros_like(y)


def _name(layer) -> str:
    return getattr(layer, "prefix", "") or "linear"


class _AscendLinearMethod(LinearMethodBase):
    """Common parameters: ``weight`` int8 ``[N, K]``, ``weight_scale`` and
    ``weight_offset`` ``[N, 1]`` (model dtype)."""

    def create_weights(
        self,
        layer,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        n = sum(output_partition_sizes)
        k = input_size_per_partition
        loader = extra_weight_attrs["weight_loader"]
        layer.ascend_dtype = params_dtype
        layer.ascend_shards = len(output_partition_sizes)
        w = torch.zeros(n, k, dtype=torch.int8)
        _add(layer, "weight", w, loader, input_dim=1, output_dim=0)
        for s in ("weight_scale", "weight_offset"):
            t = torch.zeros(n, 1, dtype=params_dtype)
            _add(layer, s, t, loader, output_dim=0)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None):
        y = layer.ascend_linear(x)
        return y if bias is None else y + bias


class AscendW8A8LinearMethod(_AscendLinearMethod):
    """W8A8 static (vllm-ascend ``methods/w8a8_static.py`` parameters): also
    ``input_scale`` / ``input_offset`` one per shard, ``deq_scale`` ``[N]``
    (fp32; int64 FP19 bits for fp16 models) and ``quant_bias`` int32 ``[N]``."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs):  # fmt: skip  # noqa: E501
        super().create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size,
            output_size, params_dtype, **extra_weight_attrs,
        )  # fmt: skip
        loader = extra_weight_attrs["weight_loader"]
        n = sum(output_partition_sizes)
        shards = len(output_partition_sizes)
        name = _name(layer)
        scale = torch.full((shards,), float("nan"), dtype=params_dtype)
        _add(layer, "input_scale", scale, _per_shard_loader(f"{name}.input_scale",
                                                             shards))  # fmt: skip
        offset = torch.zeros(shards, dtype=torch.int8)
        _add(layer, "input_offset", offset, _per_shard_loader(
            f"{name}.input_offset", shards))  # fmt: skip
        deq_dtype = torch.int64 if params_dtype == torch.float16 else torch.float32
        _add(layer, "deq_scale", torch.zeros(n, dtype=deq_dtype), loader, output_dim=0)
        qb = torch.zeros(n, dtype=torch.int32)
        _add(layer, "quant_bias", qb, loader, output_dim=0)

    def process_weights_after_loading(self, layer) -> None:
        name = _name(layer)
        scales = layer.input_scale.data.float()
        offsets = layer.input_offset.data
        if bool(torch.isnan(scales).any()):
            raise ValueError(f"{name}: no input_scale in the checkpoint")
        if bool((scales != scales[0]).any()) or bool((offsets != offsets[0]).any()):
            raise ValueError(
                f"{name}: its shards carry different input_scale / input_offset "
                f"({scales.tolist()} / {offsets.tolist()}); a fused linear "
                "quantizes its input once (one value for all shards)"
            )
        quant_bias = layer.quant_bias.data
        tensors = {
            "weight": layer.weight.data,
            "weight_scale": layer.weight_scale.data,
            "input_scale": scales[:1],
            "input_offset": offsets[:1],
            "deq_scale": layer.deq_scale.data,
            "quant_bias": quant_bias,
        }
        layer.ascend_linear = W8A8Linear.from_tensors(name, tensors, layer.ascend_dtype)
        for p in ("weight", "weight_scale", "weight_offset", "input_scale",
                  "input_offset", "deq_scale", "quant_bias"):  # fmt: skip
            delattr(layer, p)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None):
        # the float bias is folded into quant_bias (msModelSlim's quant_bias
        # formula), as on the device: ``.bias`` is not added again
        group = _row_parallel_group(layer)
        if group is None:
            return layer.ascend_linear(x)
        return _row_parallel_static(layer.ascend_linear, x, group, layer.tp_rank)


class AscendW8A8DynamicLinearMethod(_AscendLinearMethod):
    """W8A8_DYNAMIC (vllm-ascend ``methods/w8a8_dynamic.py``): per-token
    activation scales at run time; the layer's float ``bias`` is added after."""

    def process_weights_after_loading(self, layer) -> None:
        tensors = {
            "weight": layer.weight.data,
            "weight_scale": layer.weight_scale.data,
        }
        layer.ascend_linear = W8A8DynamicLinear.from_tensors(
            _name(layer), tensors, layer.ascend_dtype
        )
        for p in ("weight", "weight_scale", "weight_offset"):
            delattr(layer, p)
