"""Resume a killed streaming calibration from its last finished decoder layer.

After each layer of the linear calibration (:mod:`ascend_fa.linear.engine`) and
of the layer-major attention pass (:mod:`.layerwise`) a :class:`ResumeState`
persists, in the run's work directory (``.<output>.streaming``):

==================================  ============================================
file                                holds
==================================  ============================================
``linear-<i>.json``                 the linear calibration's records of layer
                                    ``i``, the fallback's count and errors so far
``linear-carry-<i>.safetensors``    its outputs (``hidden/<j>``, ``scan/<j>``)
``observers-<i>.safetensors``       the state of every observer of layer ``i``'s
                                    FA points (FA and KV observers:
                                    ``<point>/<tensor>``; their configuration in
                                    the header's metadata)
``carry-<i>.safetensors``           layer ``i``'s outputs of every batch
                                    (``hidden/<j>`` ``[B, S, H]``)
``resume.json``                     the run's fingerprint, ``linear_done`` and
                                    ``layers_done``
==================================  ============================================

The linear calibration's changed weights and quantized modules are in the
streamed model's spill files (``layer-<i>.safetensors``); a finished linear layer
is spilled before it is marked done, and a resumed run puts quantized modules
whose tensors come from them back in place (``QuantizedLinear.from_state``).

Each file is written under a temporary name and renamed into place, and
``resume.json`` is renamed last, so a kill at any instant (SIGKILL included) leaves
either the previous layer's state or this one's. A rerun of the same command
compares the fingerprint (:func:`run_fingerprint`: the model files' names, sizes
and safetensors headers, the calibration texts, every argument that changes the
result, the package and torch versions) and continues after the last finished
layer of the pass it was in; the
captured layer inputs' keyword arguments and padding masks are recomputed (the
embeddings), the hidden states come from the carry file. The observers then hold
exactly the states they had, so the scales, the artifact and its description are
those of an uninterrupted run. A different fingerprint discards the state.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_fa.errors import FileFormatError
from ascend_fa.linear.engine import LayerInputs
from ascend_fa.safe_files import loads_json

from .layerwise import layer_observers

__all__ = ["RESUME_FILE", "ResumeState", "open_resume", "run_fingerprint"]

#: The state file whose presence makes a rerun resume.
RESUME_FILE = "resume.json"
_FORMAT = 1
#: Fingerprint parts, in the order a mismatch is reported.
_PARTS = {
    "model": "model files",
    "data": "calibration data",
    "arguments": "arguments",
    "version": "package version",
}


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


#: Other files up to this size are hashed whole (config, tokenizer); larger ones
#: (a stray weights file) by their first MiB (their size is in the fingerprint).
_WHOLE_FILE = 64 << 20


def _file_digest(path: Path) -> str:
    """A safetensors file's header (names, dtypes, shapes, offsets); any other
    file's content (its first MiB when over 64 MiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                h.update(f.read(min(int.from_bytes(head, "little"), 100_000_000)))
        elif path.stat().st_size > _WHOLE_FILE:
            h.update(f.read(1 << 20))
        else:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def run_fingerprint(
    source_dir: Path, texts: list[str], arguments: dict[str, Any]
) -> dict[str, str]:
    """``{"model", "data", "arguments", "version"}`` digests of a run: the regular
    files of ``source_dir`` (name, size, :func:`_file_digest`), the calibration
    ``texts`` (calibration then held-out, in run order), ``arguments`` (every one
    that changes the result) and the ascend-fa and torch versions."""
    from ascend_fa import __version__

    files = [
        (p.name, p.stat().st_size, _file_digest(p))
        for p in sorted(Path(source_dir).iterdir())
        if p.is_file() and not p.name.startswith(".")
    ]
    return {
        "model": _digest(files),
        "data": _digest(texts),
        "arguments": _digest(arguments),
        "version": _digest([__version__, torch.__version__]),
    }


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _load_carry(path: Path, key: str, inputs: list[LayerInputs]) -> None:
    """Replace the hidden states of ``inputs`` by ``<key>/<j>`` of ``path``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = [n for n in f.keys() if n.startswith(f"{key}/")]
        if len(names) != len(inputs):
            raise FileFormatError(
                f"the resume state carries {len(names)} {key} batches, this run "
                f"has {len(inputs)}",
                path=path,
            )
        for j, (hidden, kwargs, mask) in enumerate(inputs):
            saved = f.get_tensor(f"{key}/{j}").to(hidden.device)
            if saved.shape != hidden.shape or saved.dtype != hidden.dtype:
                raise FileFormatError(
                    f"carried batch {j} is {list(saved.shape)} {saved.dtype}, "
                    f"this run needs {list(hidden.shape)} {hidden.dtype}",
                    path=path,
                )
            inputs[j] = (saved, kwargs, mask)


def _carry(**groups: list[LayerInputs]) -> dict[str, torch.Tensor]:
    return {
        f"{key}/{j}": h.detach().cpu().contiguous()
        for key, inputs in groups.items()
        for j, (h, _, _) in enumerate(inputs)
    }


def _record_from_dict(group: Any, d: dict[str, Any]) -> Any:
    from ascend_fa.linear import GroupRecord
    from ascend_fa.linear.search import GroupDecision

    decision = None
    if d["range"] is not None:
        lo, hi = d["range"]
        decision = GroupDecision(
            d["alpha"],
            None,
            d["clip"],
            lo,
            hi,
            d["sample_rel_error"],
            d.get("headroom") or 1.0,
        )
    return GroupRecord(
        group,
        d["quant_type"],
        decision,
        reason=d["reason"],
        kl_gain=d["kl_gain"],
        layer_gain=d["layer_gain"],
    )


class ResumeState:
    """The resume files of one run in ``directory``: a
    :class:`~.layerwise.LayerCheckpoint` for the attention pass and a
    :class:`~ascend_fa.linear.LinearCheckpoint` for the linear calibration.
    ``linear_done`` / ``done``: decoder layers of each pass finished by earlier
    runs. ``streamed`` (the :class:`~ascend_fa.streaming.StreamedModel`) spills a
    finished linear layer before it is marked done and takes the spill files back
    on resume; ``dtype`` is the linears' artifact dtype."""

    def __init__(self, directory: Path, fingerprint: dict[str, str]) -> None:
        self.directory = Path(directory)
        self.fingerprint = dict(fingerprint)
        self.linear_done = 0
        self.done = 0
        self.streamed: Any = None
        self.dtype: torch.dtype = torch.bfloat16

    def _path(self, kind: str, i: int, suffix: str = ".safetensors") -> Path:
        return self.directory / f"{kind}-{i:05d}{suffix}"

    def _commit(self) -> None:
        state = {
            "format": _FORMAT,
            "fingerprint": self.fingerprint,
            "linear_done": self.linear_done,
            "layers_done": self.done,
        }
        _atomic_write(
            self.directory / RESUME_FILE,
            lambda p: p.write_text(json.dumps(state, indent=1) + "\n"),
        )

    # -- the linear calibration (LinearCheckpoint) ----------------------------

    def restore_linears(
        self,
        model: nn.Module,
        plans: list[Any],
        inputs: list[LayerInputs],
        scan: list[LayerInputs],
        choose_float: Any,
    ) -> tuple[int, list[Any]]:
        """Put back the records and quantized modules of layers
        ``0..linear_done-1`` (their tensors come from the spill files), the
        fallback's count and errors, and the carried activations."""
        from ascend_fa.linear import W8A8DynamicExperts, W8A8DynamicLinear, W8A8Linear
        from ascend_fa.safe_files import read_text

        if not self.linear_done:
            return 0, []
        groups = {g.name: g for plan in plans for g in plan.groups}
        groups.update({p.experts.name: p.experts for p in plans if p.experts})
        records = []
        saved: dict[str, Any] = {}
        for i in range(self.linear_done):
            path = self._path("linear", i, ".json")
            saved = loads_json(read_text(path), path=path, what="resume state")
            spill = self.streamed.adopt_spill(i) if self.streamed is not None else {}
            for d in saved["records"]:
                if d["group"] not in groups:
                    raise FileFormatError(
                        f"the resume state names group {d['group']!r}, which this "
                        "model does not plan",
                        path=path,
                    )
                record = _record_from_dict(groups[d["group"]], d)
                records.append(record)
                if record.quant_type == "FLOAT":
                    continue
                if record.group.kind == "experts":
                    name = record.group.linears[0]
                    state = {
                        k[len(name) + 1 :]: t
                        for k, t in spill.items()
                        if k.startswith(name + ".")
                    }
                    act = getattr(model.get_submodule(name), "act_fn", None)
                    module = W8A8DynamicExperts.from_state(
                        state, self.dtype, act_fn=act
                    )
                    model.set_submodule(name, module)
                    continue
                cls = W8A8Linear if record.quant_type == "W8A8" else W8A8DynamicLinear
                for name in record.group.linears:
                    state = {
                        k[len(name) + 1 :]: t
                        for k, t in spill.items()
                        if k.startswith(name + ".")
                    }
                    bias = getattr(model.get_submodule(name), "bias", None)
                    if "bias" not in state and bias is not None:
                        # the spill keeps only what differs from the checkpoint:
                        # an unchanged bias is read from the shards (as fp32)
                        state["bias"] = torch.empty(
                            bias.shape, dtype=torch.float32, device="meta"
                        )
                    model.set_submodule(name, cls.from_state(state, self.dtype))
        if choose_float is not None and saved.get("fallback") is not None:
            choose_float.floats = int(saved["fallback"]["floats"])
            choose_float.errors = dict(saved["fallback"]["errors"])
        carry = self._path("linear-carry", self.linear_done - 1)
        _load_carry(carry, "hidden", inputs)
        if scan:
            _load_carry(carry, "scan", scan)
        return self.linear_done, records

    def save_linears(
        self,
        layer: int,
        records: list[Any],
        inputs: list[LayerInputs],
        scan: list[LayerInputs],
        choose_float: Any,
    ) -> None:
        """Spill layer ``layer``, persist its records, the fallback's state and
        the carried activations, then mark it done."""
        from safetensors.torch import save_file

        if self.streamed is not None:
            self.streamed.release()  # writes the layer's spill file
        self.directory.mkdir(parents=True, exist_ok=True)
        fallback = None
        if choose_float is not None and hasattr(choose_float, "floats"):
            fallback = {"floats": choose_float.floats, "errors": choose_float.errors}
        data = {"records": [r.to_dict() for r in records], "fallback": fallback}
        _atomic_write(
            self._path("linear", layer, ".json"),
            lambda p: p.write_text(json.dumps(data) + "\n"),
        )
        carry = _carry(hidden=inputs, scan=scan)
        _atomic_write(
            self._path("linear-carry", layer), lambda p: save_file(carry, str(p))
        )
        self.linear_done = layer + 1
        self._commit()
        if layer > 0:
            self._path("linear-carry", layer - 1).unlink(missing_ok=True)

    # -- the attention pass (LayerCheckpoint) ---------------------------------

    def restore(self, model: nn.Module, inputs: list[LayerInputs]) -> int:
        """Load the observers of layers ``0..done-1`` and layer ``done - 1``'s
        outputs into ``inputs``; returns ``done``."""
        from safetensors import safe_open

        if not self.done:
            return 0
        for i in range(self.done):
            path = self._path("observers", i)
            observers = layer_observers(model, f"model.layers.{i}.")
            with safe_open(str(path), framework="pt") as f:
                meta = loads_json(
                    (f.metadata() or {}).get("observers", "{}"),
                    path=path,
                    what="resume state's observers",
                )
                if set(meta) != set(observers):
                    raise FileFormatError(
                        "the resume state names other observers than this run "
                        "has; delete the directory to start over",
                        path=path,
                    )
                for key, obs in observers.items():
                    state = dict(meta[key])
                    prefix = f"{key}/"
                    for name in f.keys():
                        if name.startswith(prefix):
                            state[name[len(prefix) :]] = f.get_tensor(name)
                    obs.load_state_dict(state)
        _load_carry(self._path("carry", self.done - 1), "hidden", inputs)
        return self.done

    def save(self, layer: int, model: nn.Module, inputs: list[LayerInputs]) -> None:
        """Persist layer ``layer``'s observers and outputs, then mark it done."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for key, obs in layer_observers(model, f"model.layers.{layer}.").items():
            meta[key] = {}
            for name, value in obs.state_dict().items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{key}/{name}"] = value.detach().cpu().contiguous()
                else:
                    meta[key][name] = value
        _atomic_write(
            self._path("observers", layer),
            lambda p: save_file(
                tensors, str(p), metadata={"observers": json.dumps(meta)}
            ),
        )
        carry = _carry(hidden=inputs)
        _atomic_write(self._path("carry", layer), lambda p: save_file(carry, str(p)))
        self.done = layer + 1
        self._commit()
        if layer > 0:
            self._path("carry", layer - 1).unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove every resume file (the run starts over)."""
        (self.directory / RESUME_FILE).unlink(missing_ok=True)
        for kind in ("observers", "carry", "linear", "linear-carry"):
            for p in self.directory.glob(f"{kind}-[0-9]*"):
                p.unlink()


def open_resume(
    directory: Path, fingerprint: dict[str, str], num_layers: int
) -> tuple[ResumeState, str | None]:
    """The :class:`ResumeState` of a run in ``directory`` and the one line to say
    what happened to an earlier run's state: ``resuming after layer k of N
    (attention pass) from DIR`` (or ``(linear calibration)``), or why it was
    discarded (None: there was none)."""
    from ascend_fa.safe_files import read_json_object

    state = ResumeState(directory, fingerprint)
    path = Path(directory) / RESUME_FILE
    if not path.is_file():
        if Path(directory).is_dir():
            state.clear()  # files of a run killed before its first layer ended
        return state, None
    try:
        saved = read_json_object(path)
        linear, done = int(saved["linear_done"]), int(saved["layers_done"])
        old = saved["fingerprint"]
        ok = saved.get("format") == _FORMAT and isinstance(old, dict)
        ok = ok and 0 <= linear <= num_layers and 0 <= done <= num_layers
        ok = ok and linear + done > 0
    except (FileFormatError, KeyError, TypeError, ValueError):
        ok, old = False, {}
    if not ok:
        state.clear()
        return state, f"starting over: unreadable resume state in {directory}"
    changed = [
        label for key, label in _PARTS.items() if old.get(key) != fingerprint[key]
    ]
    if changed:
        state.clear()
        return state, (
            f"starting over: the {', '.join(changed)} changed since the interrupted "
            f"run in {directory}"
        )
    state.linear_done, state.done = linear, done
    phase = "attention pass" if done else "linear calibration"
    return state, (
        f"resuming after layer {done or linear} of {num_layers} ({phase}) from "
        f"{directory}"
    )
