"""A model whose decoder layers live in the checkpoint's shards, one in memory.

:class:`StreamedModel` builds the model skeleton without weights (parameters on
the meta device, buffers real, as ``accelerate.init_empty_weights`` does), loads
the tensors outside the decoder stack (embeddings, final norm, head) once, and puts
a forward pre-hook on every decoder layer that makes it the one **resident** layer:
the previous resident layer is evicted (its tensors back to meta), this one is
loaded. Every calibration step then runs unchanged on the skeleton (the linear
engine runs one layer at a time; a whole forward loads each layer in turn), so a
streamed calibration is the whole-model calibration, computed with one layer in
memory: the same code on the same values gives the same bits.

Loading a layer reads each of its tensors' byte range from the shards through
:class:`~ascend_fa.fp8.CheckpointReader` (DeepSeek FP8 block weights dequantized on
the fly, the rule of ``fp8 dequantize``) and casts to the model dtype, as
``from_pretrained(dtype=...)`` does. While :meth:`StreamedModel.spilling` is on (the
linear calibration changes weights: smoothing folds, quantized modules), an evicted
layer is written to a spill file in the work directory and loaded from there
afterwards. FA points (``fa_q``/``fa_k``/``fa_v``: the observers) stay in memory.
The work directory outlives a failed run: a rerun resumes from it
(:mod:`ascend_fa.calibration.resume` takes the finished layers' spill files back with
:meth:`StreamedModel.adopt_spill`) or drops them (:meth:`StreamedModel.drop_spills`);
:meth:`StreamedModel.close` removes it.

Checkpoint names: a model tensor is read under its own name; fused MoE experts
(transformers' ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``)
are stacked from the per-expert ``experts.<e>.{gate,up,down}_proj.weight`` of the
checkpoint, gate rows before up rows (transformers ``conversion_mapping.py``:
``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)`` for ``deepseek_v3``).
Tensors the model does not have (the MTP layer ``model.layers.<N>.*``) are not
read.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_fa.errors import FileFormatError, InputError, UnsupportedError
from ascend_fa.families import built_as
from ascend_fa.hf_compat import family_config, tied_weight_keys
from ascend_fa.safe_files import read_json_object

__all__ = ["Source", "StreamedModel", "return_freed_memory"]

#: submodule names of FA points (observers): never evicted
_FA_BRANCHES = ("fa_q", "fa_k", "fa_v")
_FUSED = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Source:
    """How one model tensor is read: ``names`` from the checkpoint, combined by
    ``kind`` (``"one"``: the tensor itself; ``"gate_up"`` / ``"down"``: fused
    experts stacked from per-expert weights)."""

    kind: str
    names: tuple[str, ...]


def _libc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``; a
    no-op elsewhere). Why: an evicted layer's tensors are freed, but glibc keeps
    freed chunks below its (self-raising) mmap threshold in the heap, so the
    resident set kept up to ~4 freed layers (measured: 10 layers of 51 MiB, peak
    increment 406 -> 247 MiB with a trim after each eviction)."""
    if _TRIM is not None:
        _TRIM(0)


def _is_fa(name: str) -> bool:
    return any(f".{b}." in f".{name}." for b in _FA_BRANCHES)


class StreamedModel:
    """The skeleton of the HF checkpoint at ``source_dir`` with one decoder layer
    resident at a time (see the module doc). ``work_dir`` receives spill files;
    ``load=False`` reads no tensor data (the skeleton and checks only: a plan).

    Raises :class:`~ascend_fa.errors.FileFormatError` naming the file when a shard
    or the index is unreadable, a tensor the model needs is missing, or a tensor's
    shape disagrees with the config: all checked before any tensor is read.
    """

    def __init__(
        self,
        source_dir: Path,
        work_dir: Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        load: bool = True,
    ) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from ascend_fa.fp8 import CheckpointReader

        self.source_dir = Path(source_dir)
        self.work_dir = Path(work_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        self.reader = CheckpointReader(self.source_dir)
        # The work directory outlives a failed run (a rerun resumes from it, or
        # drops what it cannot use: :meth:`drop_spills`); :meth:`close` removes it.
        stated = read_json_object(self.source_dir / "config.json", what="model config")
        if built_as(stated.get("model_type")) != stated.get("model_type"):
            config = family_config(stated)  # Kimi-K2: DeepSeek-V3's classes
        else:
            config = AutoConfig.from_pretrained(self.source_dir)
        if getattr(config, "quantization_config", None) is not None:
            # FP8 block weights are dequantized as they load: the model is float.
            del config.quantization_config
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        self.model = model
        self._adopt_conversions()
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise UnsupportedError(
                f"{type(model).__name__}: no model.layers decoder stack to stream"
            )
        self.layers = layers
        self.prefix = [f"model.layers.{i}." for i in range(len(layers))]
        keys = list(model.state_dict().keys())
        tied = tied_weight_keys(model)
        self.sources: dict[str, Source] = {}
        for key in keys:
            if key in tied and key not in self.reader:
                continue  # tied to a tensor loaded under its own name
            self.sources[key] = self._source(key)
        self._check_shapes(model.state_dict())
        self.resident: int | None = None
        #: layer -> names of its tensors held by its spill file
        self.spilled: dict[int, set[str]] = {}
        self._spill = False
        if not load:  # a plan only (--dry-run): headers read, no tensor data
            self._handles = []
            return
        self._load_keys([k for k in self.sources if self.layer_of(k) is None])
        model.tie_weights()
        self._handles = [
            layer.register_forward_pre_hook(
                lambda _m, _a, i=i: self.ensure(i), with_kwargs=False
            )
            for i, layer in enumerate(layers)
        ]

    # -- names ----------------------------------------------------------------

    def _adopt_conversions(self) -> None:
        """Record on the model the weight conversions that match the checkpoint's
        names, as ``from_pretrained`` does when it loads (transformers
        ``core_model_loading.py``: ``model._weight_conversions`` = the conversions
        that were used); the artifact writer maps names back through them, so the
        written names and their order follow the same rule as for a loaded model."""
        from ascend_fa.hf_compat import used_weight_conversions

        names = list(self.reader.names())
        self.model._weight_conversions = used_weight_conversions(self.model, names)

    def layer_of(self, name: str) -> int | None:
        """The decoder layer index of a model tensor or module name, or None."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return int(m.group(1)) if m else None

    def _missing(self, key: str, name: str) -> FileFormatError:
        index = self.source_dir / "model.safetensors.index.json"
        where = index if index.is_file() else self.source_dir
        return FileFormatError(
            f"the checkpoint has no tensor {name!r}, which the model needs for "
            f"{key} (config.json and the shards disagree)",
            path=where,
        )

    def _source(self, key: str) -> Source:
        if key in self.reader:
            return Source("one", (key,))
        m = _FUSED.match(key)
        if m is not None:
            n = int(self.model.get_submodule(m["pre"]).num_experts)
            pre = m["pre"]
            if m["kind"] == "gate_up_proj":
                names = tuple(
                    f"{pre}.{e}.{p}.weight"
                    for e in range(n)
                    for p in ("gate_proj", "up_proj")
                )
                kind = "gate_up"
            else:
                names = tuple(f"{pre}.{e}.down_proj.weight" for e in range(n))
                kind = "down"
            for name in names:
                if name not in self.reader:
                    raise self._missing(key, name)
            return Source(kind, names)
        raise self._missing(key, key)

    def _check_shapes(self, state: dict[str, torch.Tensor]) -> None:
        for key, src in self.sources.items():
            want = tuple(state[key].shape)
            infos = [self.reader.metadata(n) for n in src.names]
            shapes = [tuple(i.shape) for i in infos]
            if src.kind == "one":
                got = shapes[0]
            elif src.kind == "gate_up":
                rows = [s[0] for s in shapes]
                got = (len(shapes) // 2, sum(rows[:2]), shapes[0][1])
                if any(s[1:] != shapes[0][1:] for s in shapes):
                    got = ()
            else:
                got = (len(shapes), *shapes[0])
                if any(s != shapes[0] for s in shapes):
                    got = ()
            if got != want:
                bad = infos[0]
                raise FileFormatError(
                    f"tensor {bad.name!r} has shape {list(shapes[0])}; the model "
                    f"config needs {list(want)} for {key}",
                    path=self.source_dir / bad.shard,
                )

    # -- loading ------------------------------------------------------------

    def _read(self, key: str) -> torch.Tensor:
        src = self.sources[key]
        parts = [self.reader.tensor(n) for n in src.names]
        if src.kind == "gate_up":
            t = torch.stack(
                [torch.cat(parts[i : i + 2]) for i in range(0, len(parts), 2)]
            )
        elif src.kind == "down":
            t = torch.stack(parts)
        else:
            t = parts[0]
        return t

    def _set(self, key: str, value: torch.Tensor) -> None:
        path, _, attr = key.rpartition(".")
        module = self.model.get_submodule(path)
        old = getattr(module, attr)
        if isinstance(old, nn.Parameter):
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
        else:
            setattr(module, attr, value)

    def _current(self, key: str) -> torch.Tensor:
        # One attribute lookup, not a whole-model state_dict per layer load (that
        # made loading quadratic in depth).
        path, _, attr = key.rpartition(".")
        return getattr(self.model.get_submodule(path), attr)

    def _load_keys(self, keys: list[str]) -> None:
        for key in keys:
            want = self._current(key).dtype
            t = self._read(key)
            # from_pretrained(dtype=...) casts floating weights; others as stored
            t = t.to(self.device, want if t.is_floating_point() else t.dtype)
            self._set(key, t)

    def _layer_state(self, i: int) -> dict[str, torch.Tensor]:
        layer = self.layers[i]
        return {
            f"{self.prefix[i]}{k}": v
            for k, v in layer.state_dict(keep_vars=True).items()
            if not _is_fa(k)
        }

    def _spill_path(self, i: int) -> Path:
        return self.work_dir / f"layer-{i:05d}.safetensors"

    def load_layer(self, i: int) -> None:
        """Materialize decoder layer ``i``: the tensors its spill file holds from
        there, every other one from the shards."""
        spilled = self.spilled.get(i, set())
        if spilled:
            from safetensors import safe_open

            with safe_open(str(self._spill_path(i)), framework="pt") as f:
                for key in f.keys():
                    self._set(key, f.get_tensor(key).to(self.device))
        self._load_keys(
            [k for k in self._layer_state(i) if k not in spilled and k in self.sources]
        )

    def _as_loaded(self, key: str, t: torch.Tensor) -> bool:
        """Whether ``t`` is still exactly what loading ``key`` gives (re-read and
        compared bit for bit: nothing is assumed about what calibration changed)."""
        if key not in self.sources:
            return False
        src = self._read(key)
        if tuple(src.shape) != tuple(t.shape) or not t.is_floating_point():
            return False
        src = src.to(t.device, t.dtype)
        return torch.equal(
            src.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        )

    def evict_layer(self, i: int) -> None:
        """Put decoder layer ``i``'s tensors back on the meta device. While
        :meth:`spilling`, the tensors that differ from the checkpoint (smoothed,
        quantized) are saved first; the unchanged ones (routed experts ...) are
        read from the shards again when the layer comes back."""
        state = self._layer_state(i)
        if self._spill:
            from ascend_fa.artifact import write_safetensors

            changed = {k: t for k, t in state.items() if not self._as_loaded(k, t)}
            self.work_dir.mkdir(parents=True, exist_ok=True)
            tmp = self._spill_path(i).with_suffix(".tmp")
            write_safetensors(tmp, changed, list(changed))
            tmp.replace(self._spill_path(i))
            self.spilled[i] = set(changed)
        for key, t in state.items():
            self._set(key, torch.empty_like(t, device="meta"))
        del state
        return_freed_memory()

    def ensure(self, i: int) -> None:
        """Make decoder layer ``i`` the resident one."""
        if self.resident == i:
            return
        if self.resident is not None:
            self.evict_layer(self.resident)
            self.resident = None
        self.load_layer(i)
        self.resident = i

    def release(self) -> None:
        """Evict the resident layer (spilling it while :meth:`spilling`)."""
        if self.resident is not None:
            self.evict_layer(self.resident)
            self.resident = None

    @contextmanager
    def spilling(self) -> Iterator[None]:
        """Within the block, evicted layers are saved first (their weights change)."""
        self._spill = True
        try:
            yield
        finally:
            self.release()
            self._spill = False

    def close(self) -> None:
        """Remove the hooks and the work directory (the run is over)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        shutil.rmtree(self.work_dir, ignore_errors=True)

    # -- resume -------------------------------------------------------------

    def drop_spills(self, keep: int = 0) -> None:
        """Delete the spill files of layers ``keep`` and above (a rerun keeps
        those of the layers its resume state says are done)."""
        for path in self.work_dir.glob("layer-*.tmp"):
            path.unlink(missing_ok=True)
        for path in self.work_dir.glob("layer-*.safetensors"):
            m = re.fullmatch(r"layer-(\d+)\.safetensors", path.name)
            if m is None or int(m.group(1)) >= keep:
                path.unlink(missing_ok=True)

    def adopt_spill(self, i: int) -> dict[str, torch.Tensor]:
        """Take over decoder layer ``i``'s spill file from an earlier run: its
        tensors are loaded from there from now on. Returns them as meta tensors
        (names, shapes, dtypes; no data read)."""
        from ascend_fa.fp8.safetensors_io import LOAD_DTYPE
        from ascend_fa.safe_files import safetensors_header

        path = self._spill_path(i)
        if not path.is_file():
            raise FileFormatError(
                "the resume state needs this spill file; delete the work "
                "directory to start over",
                path=path,
            )
        out = {
            name: torch.empty(e.shape, dtype=LOAD_DTYPE[e.dtype], device="meta")
            for name, e in safetensors_header(path).items()
        }
        self.spilled[i] = set(out)
        return out

    # -- memory -------------------------------------------------------------

    def layer_bytes(self) -> int:
        """The largest decoder layer in the model dtype."""
        state = self.model.state_dict()
        sizes = [0] * len(self.layers)
        for key in self.sources:
            i = self.layer_of(key)
            if i is not None:
                sizes[i] += state[key].numel() * state[key].element_size()
        return max(sizes, default=0)

    def resident_bytes(self) -> int:
        """The tensors kept in memory all along (embeddings, final norm, head)."""
        state = self.model.state_dict()
        seen: set[int] = set()
        total = 0
        for key in self.sources:
            t = state[key]
            if self.layer_of(key) is None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def estimate_peak(self, num_samples: int, max_length: int) -> int:
        """Peak bytes of a streaming calibration, by the measured memory model
        (``ascend-fa bench streaming``, hidden 1024, 20-80 layers: 600-780 MiB):
        the interpreter with torch and transformers (400 MiB), the resident
        tensors, 6 decoder layers in fp32 (the resident one, its read and cast
        buffers, the export's copies, and what the allocator keeps of the layers
        freed before it), and the layer inputs and outputs of every sample in fp32
        (three copies: calibration, scan, one forward's intermediates)."""
        hidden = int(getattr(self.model.config, "hidden_size", 0))
        acts = 3 * num_samples * max_length * hidden * 4
        return self.resident_bytes() + 6 * self.layer_bytes() + acts + (400 << 20)

    def check_memory(self, limit: int, num_samples: int, max_length: int) -> None:
        """Refuse a run whose :meth:`estimate_peak` is over ``limit`` bytes."""
        need = self.estimate_peak(num_samples, max_length)
        if need > limit:
            raise InputError(
                f"--streaming needs about {need / 2**20:.0f} MiB here (one layer "
                f"{self.layer_bytes() / 2**20:.0f} MiB in fp32, embeddings and head "
                f"{self.resident_bytes() / 2**20:.0f} MiB, activations of "
                f"{num_samples} samples), more than --max-memory "
                f"{limit / 2**20:.0f} MiB; lower --num-samples or --max-length"
            )

    # -- export -------------------------------------------------------------

    def _float_order(self, tied_copies: bool) -> list[str]:
        """The float tensors' checkpoint names in the whole-model writer's order:
        transformers' name mapping orders them over the whole model, so it is run
        once on the whole (meta) state."""
        from ascend_fa import artifact

        quantized = [
            n
            for n, m in self.model.named_modules()
            if n and callable(getattr(m, "export_tensors", None))
        ]
        tied = tied_weight_keys(self.model)
        meta = {
            k: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for k, t in self.model.state_dict().items()
            if not _is_fa(k)
            and not any(k.startswith(q + ".") for q in quantized)
            and (tied_copies or k not in tied)
        }
        return list(artifact.hf_checkpoint_names(self.model, meta))

    def _float_layer(self, i: int) -> bool:
        """Decoder layer ``i`` holds no module that exports computed tensors (the
        quantized linears' ``export_tensors``)."""
        return not any(hasattr(m, "export_tensors") for m in self.layers[i].modules())

    def checkpoint_tensors(
        self, dtype: torch.dtype | None, *, tied_copies: bool = False
    ) -> Any:
        """What :func:`ascend_fa.artifact.checkpoint_tensors` gives for the whole
        model (same names, order, values and types), as a
        :class:`~ascend_fa.artifact.LazyTensors`: one unit (the tensors before the
        decoder stack, one decoder layer, the tensors after it) is computed at a
        time, when the writer reaches its first tensor."""
        from ascend_fa import artifact

        keys = list(self.model.state_dict().keys())
        first = next(i for i, k in enumerate(keys) if self.layer_of(k) is not None)
        pre = set(keys[:first])
        preds: list[tuple[int | None, Callable[[str], bool]]] = [
            (None, lambda n: n in pre)
        ]
        preds += [
            (i, lambda n, p=p: n.startswith(p)) for i, p in enumerate(self.prefix)
        ]
        preds.append((None, lambda n: self.layer_of(n) is None and n not in pre))
        cache: dict[int, dict[str, torch.Tensor]] = {}

        def unit(u: int, specs_only: bool = False) -> Any:
            layer, keep = preds[u]
            # A layer of float tensors only has the specs (names, shapes, dtypes)
            # of its skeleton: the spec pass leaves it unread (on the meta device;
            # casts keep meta). Quantized modules check their values as they
            # export, so their layers are loaded for the specs too.
            if layer is not None and not (specs_only and self._float_layer(layer)):
                self.ensure(layer)
            if layer is None:
                return artifact.checkpoint_tensors(
                    self.model, dtype, tied_copies=tied_copies, keep=keep
                )
            return artifact.checkpoint_tensors(
                self.model,
                dtype,
                tied_copies=tied_copies,
                keep=keep,
                part=self.layers[layer],
                part_prefix=self.prefix[layer],
            )

        floats: dict[str, artifact.TensorSpec] = {}
        quants: dict[str, artifact.TensorSpec] = {}
        owner: dict[str, int] = {}
        types: dict[str, str] = {}
        for u in range(len(preds)):
            ct = unit(u, specs_only=True)
            for name, t in ct.tensors.items():
                spec = artifact.TensorSpec(tuple(t.shape), t.dtype)
                (floats if ct.types[name] == "FLOAT" else quants)[name] = spec
                owner[name] = u
                types[name] = ct.types[name]
            del ct  # its cast copies go before the next unit loads
        self.release()
        floats = {n: floats[n] for n in self._float_order(tied_copies)}

        def load(name: str) -> torch.Tensor:
            u = owner[name]
            if u not in cache:
                cache.clear()
                return_freed_memory()
                cache[u] = unit(u).tensors
            return cache[u][name]

        specs = {**floats, **quants}
        return artifact.CheckpointTensors(
            artifact.LazyTensors(specs, load),
            {n: types[n] for n in specs},
            artifact.linear_quant_type(types),
        )
