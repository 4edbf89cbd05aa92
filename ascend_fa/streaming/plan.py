"""``calibrate --streaming --dry-run``: what a streaming run will read, hold and
write, from the checkpoint's headers alone (no tensor data is read).

Passes over the decoder stack (each reads every layer once): the linear
calibration (with ``--linear``), the FA / KV calibration forwards, the held-out
evaluation (float and fake-quant: two, when ``--heldout`` > 0), and the export
(three: sizes, float tensors, quantized tensors). Spill files (fp32, the model
dtype) hold every layer changed by the linear calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["StreamPlan", "plan_streaming"]


@dataclass
class StreamPlan:
    """The numbers :func:`plan_streaming` prints (bytes unless named)."""

    source: Path
    layers: int
    fp8: bool
    passes: dict[str, int]
    #: per decoder layer: (bytes read from the shards, shard files touched)
    layer_reads: list[tuple[int, list[str]]]
    resident_bytes: int
    layer_bytes: int
    peak_bytes: int
    spill_bytes: int
    artifact_bytes: int
    carried: int = 0
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The plan as printed lines."""

        def gib(n: int) -> str:
            return f"{n / 2**30:.2f} GiB"

        per_pass = sum(b for b, _ in self.layer_reads)
        total_passes = sum(self.passes.values())
        out = [
            f"plan: {self.layers} decoder layers from {self.source}"
            + (" (FP8 blocks, dequantized as they load)" if self.fp8 else ""),
            "passes over the layers: "
            + ", ".join(f"{k} {v}" for k, v in self.passes.items() if v)
            + f" (each reads {gib(per_pass)}; {gib(per_pass * total_passes)} in all)",
        ]
        for i, (nbytes, shards) in enumerate(self.layer_reads):
            out.append(
                f"  layer {i}: {nbytes / 2**20:.1f} MiB from {', '.join(shards)}"
            )
        out += [
            f"resident (embeddings, final norm, head, fp32): "
            f"{gib(self.resident_bytes)}; largest layer in fp32: "
            f"{gib(self.layer_bytes)}",
            f"peak memory estimate: {gib(self.peak_bytes)}",
            f"disk: spill at most {gib(self.spill_bytes)} (removed at the end), "
            f"artifact at most {gib(self.artifact_bytes)}",
        ]
        if self.carried:
            out.append(
                f"{self.carried} tensors past the decoder stack (MTP) carried "
                "through uncalibrated"
            )
        return out + self.notes


def plan_streaming(
    model: str | Path,
    *,
    num_samples: int,
    max_length: int,
    heldout: int,
    linear: bool,
    artifact_itemsize: int = 2,
) -> StreamPlan:
    """The plan of ``calibrate --streaming`` on the checkpoint directory ``model``
    (see the module doc). Raises what the run would raise for bad shards."""
    import tempfile

    from .carry import carried_names
    from .model import StreamedModel

    with tempfile.TemporaryDirectory() as tmp:
        sm = StreamedModel(Path(model), Path(tmp), load=False)
    reads: list[tuple[int, list[str]]] = []
    for i in range(len(sm.layers)):
        nbytes, shards = 0, set()
        for key, src in sm.sources.items():
            if sm.layer_of(key) != i:
                continue
            for name in src.names:
                info = sm.reader.metadata(name)
                n = 1
                for d in info.shape:
                    n *= d
                itemsize = 1 if info.fp8 else info.dtype.itemsize
                nbytes += n * itemsize
                shards.add(info.shard)
        reads.append((nbytes, sorted(shards)))
    layer_fp32 = sm.layer_bytes()
    params = sum(t.numel() for k, t in sm.model.state_dict().items() if k in sm.sources)
    passes = {
        "linear calibration": 1 if linear else 0,
        "FA/KV calibration": 1,
        "held-out": 2 if heldout else 0,
        "export": 3,
    }
    return StreamPlan(
        source=Path(model),
        layers=len(sm.layers),
        fp8=sm.reader.is_fp8,
        passes=passes,
        layer_reads=reads,
        resident_bytes=sm.resident_bytes(),
        layer_bytes=layer_fp32,
        peak_bytes=sm.estimate_peak(num_samples, max_length),
        spill_bytes=layer_fp32 * len(sm.layers) if linear else 0,
        artifact_bytes=params * artifact_itemsize,
        carried=len(carried_names(sm.reader.names(), len(sm.layers))),
    )
