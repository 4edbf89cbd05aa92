"""DeepSeek routed experts as W8A8_DYNAMIC: every expert's three projections in int8.

transformers 5 holds the routed experts of a DeepSeek-V3 MoE layer as two fused
parameters, ``experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's ``gate_proj``
rows, then its ``up_proj`` rows) and ``experts.down_proj`` ``[E, H, I]``, run by
``DeepseekV3Experts.forward``: per expert the router hit, the routed tokens' ``gate``
and ``up`` projections, ``act(gate) * up``, the ``down`` projection, times the
routing weight, summed into the tokens' outputs. The checkpoint names them per
expert, ``<experts>.{e}.{gate,up,down}_proj.weight`` (transformers' weight
conversion splits and merges them).

:class:`W8A8DynamicExperts` replaces that module. Every expert's projections are
quantized as :class:`~.modules.W8A8DynamicLinear` quantizes a linear (int8 codes
symmetric per output channel, scales rounded up to the model dtype), and the
activations per token at run time, through the same ops
(:func:`~ascend_fa.atb_ops.linear.dynamic_quant`,
:func:`~ascend_fa.atb_ops.linear.quant_matmul_dynamic`): the routed tokens before
``gate``/``up`` (one product, as the device's ``w13``), and ``act(gate) * up``
before ``down``. The consumer's layout: vllm-ascend's MoE W8A8_DYNAMIC method
declares ``w13_weight`` int8 ``[E, 2I, H]``, ``w2_weight`` int8 ``[E, H, I]``,
``w13_weight_scale`` / ``w13_weight_offset`` ``[E, 2I, 1]`` and ``w2_weight_scale``
/ ``w2_weight_offset`` ``[E, H, 1]`` in the model dtype
(vllm-project/vllm-ascend ``vllm_ascend/quantization/methods/w8a8_dynamic.py``
@182b75e, ``AscendW8A8DynamicFusedMoEMethod.get_weight`` /
``get_dynamic_quant_param``), filled from the per-expert checkpoint tensors
``<experts>.{e}.{gate,up,down}_proj.{weight,weight_scale,weight_offset}``, which
:meth:`W8A8DynamicExperts.export_tensors` writes (weight ``[N, K]`` int8,
``weight_scale`` ``[N, 1]``, ``weight_offset`` zeros ``[N, 1]``: the tensors of a
W8A8_DYNAMIC linear).

Static W8A8 keeps the routed experts float: a per-tensor activation range per
expert needs the tokens routed to it, which a calibration set leaves at zero for
many experts, and one MindIE model does not mix W8A8 with W8A8_DYNAMIC.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from ascend_fa.atb_ops.linear import dynamic_quant, quant_matmul_dynamic
from ascend_fa.errors import FileFormatError, UnsupportedError
from ascend_fa.families import MoeLayout

from .modules import QuantizedLinear, check_linear_shape, quantize_weight

__all__ = [
    "PROJECTIONS",
    "W8A8DynamicExperts",
    "checkpoint_owner",
    "expert_projections",
    "expert_tensor_owner",
    "memory_owner",
    "is_fused_experts",
]

#: The per-expert projections (gate, up, down), as most checkpoints name them.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_NAME = re.compile(
    r"^(?P<owner>.+)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$"
)


def _rename_block(owner: str, src: str, dst: str) -> str:
    """``<layer>.<src>.experts`` -> ``<layer>.<dst>.experts`` (other names as
    they are)."""
    tail = f".{src}.experts"
    if src == dst or not owner.endswith(tail):
        return owner
    return owner[: -len(tail)] + f".{dst}.experts"


def checkpoint_owner(owner: str, layout: MoeLayout | None) -> str:
    """The checkpoint's name of the experts module ``owner`` (in-memory
    ``<layer>.<block>.experts``): the block renamed as ``layout`` says
    (Mixtral: ``mlp`` -> ``block_sparse_moe``)."""
    if layout is None:
        return owner
    return _rename_block(owner, layout.block, layout.checkpoint_block)


def memory_owner(owner: str, layout: MoeLayout | None) -> str:
    """The inverse of :func:`checkpoint_owner`."""
    if layout is None:
        return owner
    return _rename_block(owner, layout.checkpoint_block, layout.block)


def expert_projections(layout: MoeLayout | None) -> tuple[str, str, str]:
    """The checkpoint names of an expert's gate, up and down projections."""
    return layout.projections if layout is not None else PROJECTIONS


def is_fused_experts(module: nn.Module | None) -> bool:
    """Whether ``module`` holds routed experts as transformers 5's fused
    parameters (a 3-D ``gate_up_proj``)."""
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3


def expert_tensor_owner(prefix: str) -> tuple[str, int, str] | None:
    """``"<experts>.{e}.{proj}"`` -> ``(experts, e, proj)`` (None for another name)."""
    m = _NAME.match(prefix)
    return None if m is None else (m["owner"], int(m["e"]), m["proj"])


def _quantize(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` float -> int8 codes ``[E, N, K]``, fp32 scales ``[E, N]``: each
    expert's rows quantized as one linear's (:func:`~.modules.quantize_weight`),
    one expert at a time (DeepSeek-V3's fused ``gate_up_proj`` is 30 GiB in fp32:
    whole-tensor temporaries would be several times that)."""
    e, n, k = w.shape
    codes = torch.empty((e, n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty((e, n), dtype=torch.float32, device=w.device)
    for i in range(e):
        codes[i], scale[i] = quantize_weight(w[i].detach(), dtype)
    return codes, scale


class W8A8DynamicExperts(QuantizedLinear):
    """The routed experts of one MoE layer, W8A8_DYNAMIC (see the module doc).

    Buffers: ``gate_up_weight`` int8 ``[E, 2I, H]``, ``gate_up_scale`` fp32 ``[E,
    2I]``, ``down_weight`` int8 ``[E, H, I]``, ``down_scale`` fp32 ``[E, H]``;
    ``act_fn`` the float module's activation. Called as the module it replaces:
    ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
    """

    quant_type = "W8A8_DYNAMIC"
    BUFFERS = ("gate_up_weight", "gate_up_scale", "down_weight", "down_scale")

    def __init__(
        self,
        gate_up_weight: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down_weight: torch.Tensor,
        down_scale: torch.Tensor,
        *,
        act_fn: nn.Module,
        dtype: torch.dtype,
        layout: MoeLayout | None = None,
    ) -> None:
        e, two_i, h = gate_up_weight.shape
        super().__init__(int(h), int(h), dtype)
        self.num_experts, self.intermediate = int(e), int(two_i) // 2
        self.act_fn = act_fn
        self.layout = layout
        self.register_buffer("gate_up_weight", gate_up_weight.to(torch.int8))
        self.register_buffer("gate_up_scale", gate_up_scale.float().reshape(e, -1))
        self.register_buffer("down_weight", down_weight.to(torch.int8))
        self.register_buffer("down_scale", down_scale.float().reshape(e, -1))

    @classmethod
    def from_float(
        cls,
        experts: nn.Module,
        *,
        dtype: torch.dtype,
        name: str = "",
        layout: MoeLayout | None = None,
    ) -> W8A8DynamicExperts:
        """Quantize a transformers experts module (``gate_up_proj`` ``[E, 2I, H]``,
        ``down_proj`` ``[E, H, I]``, ``act_fn``); ``layout`` gives the checkpoint
        names :meth:`export_tensors` writes (None: ``mlp.experts.{e}.gate_proj``
        ...)."""
        gate_up = getattr(experts, "gate_up_proj", None)
        down = getattr(experts, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise UnsupportedError(
                f"{name}: expected fused experts with gate_up_proj [E, 2I, H] and "
                f"down_proj [E, H, I], got {type(experts).__name__}"
            )
        e, two_i, h = gate_up.shape
        if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
            raise UnsupportedError(
                f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]"
            )
        for proj, k, n in (("gate_proj", h, two_i // 2), ("down_proj", two_i // 2, h)):
            check_linear_shape(f"{name}.0.{proj}", int(k), int(n))
        gu_codes, gu_scale = _quantize(gate_up, dtype)
        d_codes, d_scale = _quantize(down, dtype)
        return cls(
            gu_codes,
            gu_scale,
            d_codes,
            d_scale,
            act_fn=experts.act_fn,
            dtype=dtype,
            layout=layout,
        )

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        act_fn: nn.Module | None = None,
    ) -> W8A8DynamicExperts:
        """The module whose buffers are ``state`` (its own ``state_dict()``), with
        the activation ``act_fn`` (SiLU when not given: DeepSeek-V3's)."""
        missing = [n for n in cls.BUFFERS if n not in state]
        if missing:
            raise ValueError(f"{cls.__name__}.from_state: no {missing[0]!r}")
        module = cls.__new__(cls)
        e, two_i, h = state["gate_up_weight"].shape
        QuantizedLinear.__init__(module, int(h), int(h), dtype)
        module.num_experts, module.intermediate = int(e), int(two_i) // 2
        module.act_fn = act_fn if act_fn is not None else nn.SiLU()
        module.layout = None
        for name in cls.BUFFERS:
            module.register_buffer(name, state[name])
        return module

    @classmethod
    def from_tensors(
        cls,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        act_fn: nn.Module,
        num_experts: int,
        layout: MoeLayout | None = None,
    ) -> W8A8DynamicExperts:
        """Rebuild from an artifact's per-expert tensors ``<name>.{e}.{proj}.*``
        (every expert ``0..num_experts-1``, all three projections; ``name`` and
        ``proj`` as the checkpoint names them, see ``layout``)."""
        names = expert_projections(layout)
        codes: dict[str, list[torch.Tensor]] = {p: [] for p in PROJECTIONS}
        scales: dict[str, list[torch.Tensor]] = {p: [] for p in PROJECTIONS}
        for e in range(num_experts):
            for proj, ckpt in zip(PROJECTIONS, names, strict=True):
                p = f"{checkpoint_owner(name, layout)}.{e}.{ckpt}"
                w, ws = tensors.get(f"{p}.weight"), tensors.get(f"{p}.weight_scale")
                if w is None or ws is None:
                    raise FileFormatError(
                        f"{p}: a W8A8_DYNAMIC expert needs weight and weight_scale"
                    )
                if w.dtype != torch.int8 or w.dim() != 2 or ws.numel() != w.shape[0]:
                    raise FileFormatError(
                        f"{p}: expected int8 weight [N, K] and weight_scale [N, 1]"
                    )
                codes[proj].append(w)
                scales[proj].append(ws.float().reshape(-1))
        try:
            gate_up = torch.stack(
                [
                    torch.cat([g, u])
                    for g, u in zip(codes["gate_proj"], codes["up_proj"])
                ]
            )
            gate_up_scale = torch.stack(
                [
                    torch.cat([g, u])
                    for g, u in zip(scales["gate_proj"], scales["up_proj"])
                ]
            )
            down = torch.stack(codes["down_proj"])
        except RuntimeError as exc:
            raise FileFormatError(
                f"{name}: experts of different shapes ({exc})"
            ) from None
        e, two_i, h = gate_up.shape
        if tuple(down.shape) != (e, h, two_i // 2):
            raise FileFormatError(
                f"{name}: down_proj [{down.shape[1]}, {down.shape[2]}] does not fit "
                f"gate_proj/up_proj [{two_i // 2}, {h}]"
            )
        return cls(
            gate_up,
            gate_up_scale,
            down,
            torch.stack(scales["down_proj"]),
            act_fn=act_fn,
            dtype=dtype,
            layout=layout,
        )

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on its routed tokens ``x`` ``[M, H]``."""
        q, pts = dynamic_quant(x)
        gate_up = quant_matmul_dynamic(
            q, self.gate_up_weight[e], self.gate_up_scale[e], pts, out_dtype=x.dtype
        )
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        q, pts = dynamic_quant(h)
        return quant_matmul_dynamic(
            q, self.down_weight[e], self.down_scale[e], pts, out_dtype=x.dtype
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue  # transformers' "no expert" index
            token, slot = torch.where(top_k_index == e)
            y = self._expert(e, hidden_states[token])
            y = y * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def export_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The consumer tensors of every expert, under the checkpoint's names
        (``prefix`` the in-memory module name; ``layout`` renames)."""
        d, i = self.dtype, self.intermediate
        layout = getattr(self, "layout", None)
        gate, up, down = expert_projections(layout)
        owner = checkpoint_owner(prefix, layout)
        out: dict[str, torch.Tensor] = {}
        for e in range(self.num_experts):
            parts = (
                (gate, self.gate_up_weight[e, :i], self.gate_up_scale[e, :i]),
                (up, self.gate_up_weight[e, i:], self.gate_up_scale[e, i:]),
                (down, self.down_weight[e], self.down_scale[e]),
            )
            for proj, codes, scale in parts:
                p = f"{owner}.{e}.{proj}"
                n = codes.shape[0]
                out[f"{p}.weight"] = codes.cpu().clone().contiguous()
                s = scale.to(d).reshape(n, 1).cpu().contiguous()
                if not bool(torch.isfinite(s).all()):
                    raise UnsupportedError(f"{p}.weight_scale: not finite")
                out[f"{p}.weight_scale"] = s
                out[f"{p}.weight_offset"] = torch.zeros(n, 1, dtype=d)
        return out

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"num_experts={self.num_experts}, hidden={self.in_features}, "
            f"intermediate={self.intermediate}, quant_type={self.quant_type}, "
            f"dtype={dtype}"
        )
