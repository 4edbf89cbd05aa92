"""The FA3 processor: inject -> observe -> fake-quantize, per recipe item (seed 001).

=============  =========================================  ==========================
stage          ``fa_q``/``fa_k``/``fa_v`` become          done by
=============  =========================================  ==========================
preprocess     :class:`FA3QuantPlaceHolder` (identity)     the model adapter
process        :class:`FA3Observer` (identity, records)    :meth:`FA3Processor.process`
(forwards)     calibration data flows through the model    the caller
postprocess    :class:`FA3FakeQuant` (quant -> dequant)    reduce across ranks once,
                                                           then qparams per head
=============  =========================================  ==========================

All three module kinds share the call contract ``fa_x(x [B, H, S, D], token_mask
[B, S] bool | None) -> Tensor``. Each stage only touches attention modules that match
its :class:`FA3QuantConfig` and leaves modules already past it alone, so re-running a
stage changes nothing. :meth:`FA3Processor.export_scales` is the export hook and
:meth:`FA3Processor.remove` restores the model bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.hf import delete_points, fa_points, find_fa_modules, set_point
from ascend_fa.adapters.placeholder import (
    FA_BRANCHES,
    FA3QuantAdapterInterface,
    FA3QuantPlaceHolder,
)
from ascend_fa.artifact.format import ScaleMap, fa_tensor_name, per_head_vector
from ascend_fa.atb_ops import dequantize_per_head, quantize_per_head

from .distributed import all_reduce_observer, is_distributed
from .observers import PerHeadObserver
from .recipe import FA3QuantConfig, check_patterns

__all__ = [
    "FA3Observer",
    "FA3FakeQuant",
    "FA3Processor",
    "find_fa_modules",
    "ScaleMap",
]


class FA3Observer(nn.Module):
    """Identity that feeds each ``x`` ``[B, H, S, D]`` to a :class:`PerHeadObserver`."""

    def __init__(
        self, branch: str, observer: PerHeadObserver, head_dim: int | None = None
    ) -> None:
        super().__init__()
        self.branch = branch
        self.num_heads = observer.num_heads
        self.head_dim = head_dim
        self.observer = observer

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.observer.update(x.detach(), token_mask)
        return x

    def extra_repr(self) -> str:
        return f"branch={self.branch}, {self.observer!r}"


class FA3FakeQuant(nn.Module):
    """``dequantize(quantize(x))`` per head with fixed scales, output in ``x``'s dtype.

    Buffers ``scale`` ``[H]`` fp32 and ``offset`` ``[H]`` int8 (zeros: the Ascend
    kernels take symmetric INT8). ``token_mask`` is accepted and ignored: padded
    positions are quantized like any other (their outputs are never used).
    """

    scale: torch.Tensor
    offset: torch.Tensor

    def __init__(
        self,
        branch: str,
        scale: torch.Tensor,
        offset: torch.Tensor | None = None,
        head_dim: int | None = None,
    ) -> None:
        super().__init__()
        if scale.dim() != 1:
            raise ValueError(
                f"FA3FakeQuant({branch}): scale must be [H], got shape "
                f"{tuple(scale.shape)}"
            )
        if offset is None:
            offset = torch.zeros(scale.shape, dtype=torch.int8, device=scale.device)
        if offset.shape != scale.shape:
            raise ValueError(
                f"FA3FakeQuant({branch}): offset shape {tuple(offset.shape)} "
                f"!= scale shape {tuple(scale.shape)}"
            )
        if bool((offset != 0).any()):
            raise ValueError(
                f"FA3FakeQuant({branch}): offsets must be 0 (symmetric INT8)"
            )
        self.branch = branch
        self.num_heads = int(scale.shape[0])
        self.head_dim = head_dim
        self.register_buffer("scale", scale.detach().to(torch.float32).clone())
        self.register_buffer("offset", offset.detach().to(torch.int8).clone())

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = quantize_per_head(x, self.scale, axis=1)
        return dequantize_per_head(q, self.scale, axis=1, dtype=x.dtype)

    def extra_repr(self) -> str:
        return f"branch={self.branch}, num_heads={self.num_heads}"


def _normalize_scale(
    name: str, branch: str, t: Any, heads: int | None, what: str
) -> torch.Tensor:
    return per_head_vector(
        t, f"load_scales: {fa_tensor_name(name, branch, what)}", heads
    )


class FA3Processor:
    """Runs the three FA3 stages for one ``fa3_quant`` recipe item.

    The adapter and root name given to :meth:`preprocess` are remembered for the
    later stages; each stage also takes ``root_name`` explicitly.
    """

    def __init__(self, config: FA3QuantConfig | None = None) -> None:
        self.config = config if config is not None else FA3QuantConfig()
        self.adapter: FA3QuantAdapterInterface | None = None
        self.root_name = ""

    # ------------------------------------------------------------ helpers
    def _root(self, root_name: str | None) -> str:
        return self.root_name if root_name is None else root_name

    def _selected(
        self, model: nn.Module, root_name: str | None
    ) -> dict[str, nn.Module]:
        return {
            n: m
            for n, m in find_fa_modules(model, self._root(root_name)).items()
            if self.config.matches(n)
        }

    # ------------------------------------------------------------- stages
    def preprocess(
        self, model: nn.Module, adapter: FA3QuantAdapterInterface, root_name: str = ""
    ) -> list[str]:
        """Stage 1: the adapter injects placeholders into matching attention modules.

        Warns about include/exclude patterns that matched none of the attention
        modules the adapter considered. Returns the names of matching modules now
        holding ``fa_*`` submodules.
        """
        if not isinstance(adapter, FA3QuantAdapterInterface):
            raise ValueError(
                "preprocess: adapter must implement FA3QuantAdapterInterface, "
                f"got {type(adapter).__name__}"
            )
        considered: list[str] = []

        def should_inject(name: str) -> bool:
            considered.append(name)
            return self.config.matches(name)

        adapter.inject_fa3_placeholders(root_name, model, should_inject)
        self.adapter, self.root_name = adapter, root_name
        check_patterns(self.config, dict.fromkeys(considered))
        return list(self._selected(model, root_name))

    def process(self, model: nn.Module, root_name: str | None = None) -> list[str]:
        """Stage 2: placeholders -> observers (identities that record per-head ranges).

        Returns the names of the observer points created (``"<attn>.fa_q"``...).
        """
        created = []
        for name, module in self._selected(model, root_name).items():
            for branch, child in fa_points(module):
                if not isinstance(child, FA3QuantPlaceHolder):
                    continue  # already observing or fake-quantized
                s = self.config.branch_settings(branch)
                obs = PerHeadObserver(
                    child.num_heads,
                    method=s.method,
                    ratio=s.ratio,
                    accumulate=s.accumulate,
                    max_samples=s.max_samples,
                    name=f"{name}.{branch}",
                    head_axis=1,
                )
                set_point(module, branch, FA3Observer(branch, obs, child.head_dim))
                created.append(f"{name}.{branch}")
        return created

    def postprocess(
        self,
        model: nn.Module,
        root_name: str | None = None,
        *,
        group: object | None = None,
    ) -> list[str]:
        """Stage 3: observers -> fake-quant modules holding their scales.

        With ``torch.distributed`` initialised every observer is first reduced across
        ranks (once, here; all ranks must call this). Returns the converted points.
        """
        converted = []
        for name, module in self._selected(model, root_name).items():
            for branch, child in fa_points(module):
                if isinstance(child, FA3QuantPlaceHolder):
                    raise ValueError(
                        f"postprocess: {name}.{branch} is still a placeholder; "
                        "run process() and calibration forwards first"
                    )
                if not isinstance(child, FA3Observer):
                    continue
                if is_distributed():
                    all_reduce_observer(child.observer, group)
                scale, offset = child.observer.qparams()
                set_point(
                    module, branch, FA3FakeQuant(branch, scale, offset, child.head_dim)
                )
                converted.append(f"{name}.{branch}")
        return converted

    # ------------------------------------------------------ export / import
    def export_scales(self, model: nn.Module, root_name: str | None = None) -> ScaleMap:
        """The export hook: ``{attn: {"fa_q": (scale [H] fp32, offset [H] int8), ...}}``
        for every matching attention module (all three branches fake-quantized)."""
        out: ScaleMap = {}
        for name, module in self._selected(model, root_name).items():
            entry = {}
            for branch in FA_BRANCHES:
                child = module._modules.get(branch)
                if not isinstance(child, FA3FakeQuant):
                    kind = type(child).__name__ if child is not None else "missing"
                    raise ValueError(
                        f"export_scales: {name}.{branch} is {kind}, not "
                        "fake-quantized; run postprocess() first"
                    )
                entry[branch] = (
                    child.scale.detach().clone(),
                    child.offset.detach().clone(),
                )
            out[name] = entry
        return out

    def load_scales(
        self, model: nn.Module, scales: ScaleMap, root_name: str | None = None
    ) -> list[str]:
        """Install known scales (e.g. from an artifact) as fake-quant modules.

        ``scales[attn][branch] = (scale, offset)``; scale ``[H]``, ``[H, 1]`` or
        ``[H, head_dim]``. Every named module must hold that branch already (inject
        first). Returns the points loaded.
        """
        mods = find_fa_modules(model, self._root(root_name))
        loaded = []
        for name, branches in scales.items():
            if name not in mods:
                raise ValueError(
                    f"load_scales: no attention module {name!r} with fa_* "
                    "points (inject placeholders first)"
                )
            module = mods[name]
            for branch, pair in branches.items():
                child = module._modules.get(branch)
                if branch not in FA_BRANCHES or child is None:
                    raise ValueError(f"load_scales: {name} has no {branch!r} point")
                scale, offset = pair
                heads = getattr(child, "num_heads", None)
                scale = _normalize_scale(name, branch, scale, heads, "scale")
                offset = _normalize_scale(name, branch, offset, heads, "offset")
                set_point(
                    module,
                    branch,
                    FA3FakeQuant(
                        branch, scale, offset, getattr(child, "head_dim", None)
                    ),
                )
                loaded.append(f"{name}.{branch}")
        return loaded

    # -------------------------------------------------------- resume
    def state_dict(
        self, model: nn.Module, root_name: str | None = None
    ) -> dict[str, Any]:
        """Observer states ``{"<attn>.fa_x": PerHeadObserver.state_dict()}``."""
        return {
            f"{name}.{branch}": child.observer.state_dict()
            for name, module in self._selected(model, root_name).items()
            for branch, child in fa_points(module)
            if isinstance(child, FA3Observer)
        }

    def load_state_dict(
        self, model: nn.Module, state: dict[str, Any], root_name: str | None = None
    ) -> None:
        """Resume observers from :meth:`state_dict` (run :meth:`process` first)."""
        points = {
            f"{name}.{branch}": child
            for name, module in self._selected(model, root_name).items()
            for branch, child in fa_points(module)
        }
        for key, sd in state.items():
            child = points.get(key)
            if not isinstance(child, FA3Observer):
                kind = "missing" if child is None else type(child).__name__
                raise ValueError(
                    f"load_state_dict: {key} is {kind}, not an observer "
                    "(run process() first)"
                )
            child.observer.load_state_dict(sd)

    # -------------------------------------------------------- removal
    def remove(
        self, model: nn.Module, adapter: FA3QuantAdapterInterface | None = None
    ) -> None:
        """Delete every ``fa_q``/``fa_k``/``fa_v`` under ``model`` and let the adapter
        undo its wiring (its optional ``remove_fa3_placeholders(root_module)``), so
        the model is the original bit for bit."""
        adapter = adapter if adapter is not None else self.adapter
        cleanup: Callable[[nn.Module], None] | None = getattr(
            adapter, "remove_fa3_placeholders", None
        )
        if cleanup is not None:
            cleanup(model)
        delete_points(model)
