"""Resume a killed streaming calibration from its last finished decoder layer.

After each layer of the layer-major attention pass (:mod:`.layerwise`) a
:class:`ResumeState` persists, in the run's work directory (``.<output>.streaming``):

=============================  =================================================
file                           holds
=============================  =================================================
``observers-<i>.safetensors``  the state of every observer of layer ``i``'s FA
                               points (FA and KV observers: ``<point>/<tensor>``;
                               their configuration in the header's metadata)
``carry-<i>.safetensors``      layer ``i``'s outputs of every batch (``hidden/<j>``
                               ``[B, S, H]``): the next layer's inputs
``resume.json``                the fingerprint of the run and ``layers_done``
=============================  =================================================

Each file is written under a temporary name and renamed into place, and
``resume.json`` is renamed last, so a kill at any instant (SIGKILL included) leaves
either the previous layer's state or this one's. A rerun of the same command
compares the fingerprint (:func:`run_fingerprint`: the model files' names, sizes
and safetensors headers, the calibration texts, every argument that changes the
result, the package and torch versions) and continues after ``layers_done``; the
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


def _file_digest(path: Path) -> str:
    """A safetensors file's header (names, dtypes, shapes, offsets) and size; any
    other file's content (config, tokenizer: small)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                h.update(f.read(int.from_bytes(head, "little")))
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


class ResumeState:
    """The resume files of one run in ``directory`` (a :class:`~.layerwise.
    LayerCheckpoint`). ``done``: decoder layers finished by earlier runs."""

    def __init__(self, directory: Path, fingerprint: dict[str, str], done: int = 0):
        self.directory = Path(directory)
        self.fingerprint = dict(fingerprint)
        self.done = done

    def _observers_path(self, i: int) -> Path:
        return self.directory / f"observers-{i:05d}.safetensors"

    def _carry_path(self, i: int) -> Path:
        return self.directory / f"carry-{i:05d}.safetensors"

    # -- LayerCheckpoint ------------------------------------------------------

    def restore(self, model: nn.Module, inputs: list[LayerInputs]) -> int:
        """Load the observers of layers ``0..done-1`` and layer ``done - 1``'s
        outputs into ``inputs``; returns ``done``."""
        from safetensors import safe_open

        if not self.done:
            return 0
        for i in range(self.done):
            path = self._observers_path(i)
            observers = layer_observers(model, f"model.layers.{i}.")
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("observers", "{}"))
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
        path = self._carry_path(self.done - 1)
        with safe_open(str(path), framework="pt") as f:
            if len(list(f.keys())) != len(inputs):
                raise FileFormatError(
                    f"the resume state carries {len(list(f.keys()))} batches, "
                    f"this run has {len(inputs)}",
                    path=path,
                )
            for j, (hidden, kwargs, mask) in enumerate(inputs):
                saved = f.get_tensor(f"hidden/{j}").to(hidden.device)
                if saved.shape != hidden.shape or saved.dtype != hidden.dtype:
                    raise FileFormatError(
                        f"carried batch {j} is {list(saved.shape)} {saved.dtype}, "
                        f"this run needs {list(hidden.shape)} {hidden.dtype}",
                        path=path,
                    )
                inputs[j] = (saved, kwargs, mask)
        return self.done

    def save(self, layer: int, model: nn.Module, inputs: list[LayerInputs]) -> None:
        """Persist layer ``layer``'s observers and outputs, then mark it done."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for key, obs in layer_observers(model, f"model.layers.{layer}.").items():
            state = obs.state_dict()
            meta[key] = {}
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{key}/{name}"] = value.detach().cpu().contiguous()
                else:
                    meta[key][name] = value
        _atomic_write(
            self._observers_path(layer),
            lambda p: save_file(
                tensors, str(p), metadata={"observers": json.dumps(meta)}
            ),
        )
        carry = {
            f"hidden/{j}": h.detach().cpu().contiguous()
            for j, (h, _, _) in enumerate(inputs)
        }
        _atomic_write(self._carry_path(layer), lambda p: save_file(carry, str(p)))
        state = {
            "format": _FORMAT,
            "fingerprint": self.fingerprint,
            "layers_done": layer + 1,
        }
        _atomic_write(
            self.directory / RESUME_FILE,
            lambda p: p.write_text(json.dumps(state, indent=1) + "\n"),
        )
        self.done = layer + 1
        if layer > 0:
            self._carry_path(layer - 1).unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove every resume file (the run starts over)."""
        (self.directory / RESUME_FILE).unlink(missing_ok=True)
        for pattern in ("observers-*.safetensors*", "carry-*.safetensors*"):
            for p in self.directory.glob(pattern):
                p.unlink()


def open_resume(
    directory: Path, fingerprint: dict[str, str], num_layers: int
) -> tuple[ResumeState, str | None]:
    """The :class:`ResumeState` of a run in ``directory`` and the one line to say
    what happened to an earlier run's state: ``resuming after layer k of N from
    DIR``, or why it was discarded (None: there was none)."""
    from ascend_fa.safe_files import read_json_object

    state = ResumeState(directory, fingerprint)
    path = Path(directory) / RESUME_FILE
    if not path.is_file():
        if Path(directory).is_dir():
            state.clear()  # files of a run killed before its first layer ended
        return state, None
    try:
        saved = read_json_object(path)
        done = int(saved["layers_done"])
        old = saved["fingerprint"]
        ok = saved.get("format") == _FORMAT and isinstance(old, dict)
    except (FileFormatError, KeyError, TypeError, ValueError):
        ok, done, old = False, 0, {}
    if not ok or not 0 < done <= num_layers:
        state.clear()
        return state, f"discarding the unreadable resume state in {directory}"
    changed = [
        label for key, label in _PARTS.items() if old.get(key) != fingerprint[key]
    ]
    if changed:
        state.clear()
        return state, (
            f"starting over: the {', '.join(changed)} changed since the interrupted "
            f"run in {directory}"
        )
    state.done = done
    return state, f"resuming after layer {done} of {num_layers} from {directory}"
