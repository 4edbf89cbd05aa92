"""A genuine msModelSlim W8A8 export, written by msModelSlim's own saver.

msmodelslim 26.1.0 (PyPI) ``core/quant_service/modelslim_v1/save/ascendv1.py``:
``AscendV1Saver.post_run`` walks the model, writes each quantized linear through
``on_w8a8_static`` / ``on_w8a8_dynamic_per_channel`` and every other parameter as
``FLOAT``, then the description (``JsonWriter``: the tensor entries plus
``version``, ``model_quant_type``, ``metadata``, ``group_size`` and ``optional``),
the weights (``BufferedSafetensorsWriter``), copies the source's ``.json`` /
``.py`` / ``.txt`` / ``.jinja`` files (``copy_files``) and removes
``quantization_config`` from the copied config.json
(``remove_quantization_config``).

The linears it saves are quantized here by msModelSlim's own processor, as a
``linear_quant`` step of a real run does: ``LinearQuantProcessor``
(``processor/quant/linear.py`` L107-137: ``preprocess`` puts a ``LinearQuantizer``
in place of every ``nn.Linear`` of a decoder layer, the model's forward over the
calibration batches feeds its observers, ``postprocess`` swaps in ``deploy()``'s
IR module), with the ``qconfig`` of msModelSlim's own recipes (W8A8_DYNAMIC:
``default_w8a8_dynamic`` of ``lab_practice/qwen3_5_moe/qwen3_5_moe_w8a8.yaml``
L15-25, per-token symmetric activations, per-channel symmetric weights; W8A8:
``default_w8a8`` of ``lab_practice/qwen3_vl/qwen3_vl_w8a8.yaml`` L14-24,
per-tensor asymmetric activations). The calibration batches are fixed random
token ids instead of a data set. Shapes follow from that code: the per-channel
weight observer reduces ``weight.T`` over dim 0 without keepdim
(``core/quantizer/impl/minmax.py`` L214, L225), so ``weight_scale`` is ``[N]``,
and the saver writes it as ``[N, 1]`` (``ascendv1.py`` L341 ``unsqueeze(-1)``).

The package installs without its dependencies' heavy parts (``pip install
--no-deps msmodelslim==26.1.0`` plus ``easydict einops pygtrie wcmatch scipy``, which
``ci/setup.sh dev`` installs); :func:`saver_available` says why not when it cannot
be imported.

msModelSlim patches pydantic when it is imported
(``msmodelslim/utils/patch/pydantic.py``: every later ``ValidationError`` becomes its
``SchemaValidateError``), so it never runs in the test process: both functions run
this file in a child interpreter (``python msmodelslim_saver.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["MSMODELSLIM_VERSION", "saver_available", "genuine_export"]

MSMODELSLIM_VERSION = "26.1.0"
_SAVE = "msmodelslim.core.quant_service.modelslim_v1.save"


def _child(*args: str) -> subprocess.CompletedProcess:
    """This file run in a child interpreter (msModelSlim stays out of this one)."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    return subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def saver_available() -> str | None:
    """None when msModelSlim's saver imports (in a child process), else why not."""
    proc = _child("check")
    if proc.returncode == 0:
        return None
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return tail[-1] if tail else f"saver check exited {proc.returncode}"


def _check_here() -> None:
    from importlib.metadata import version

    have = version("msmodelslim")
    if have != MSMODELSLIM_VERSION:
        raise SystemExit(
            f"msmodelslim {have} installed, the fixtures need {MSMODELSLIM_VERSION}"
        )
    try:
        __import__(f"{_SAVE}.ascendv1")
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        raise SystemExit(
            f"msmodelslim {MSMODELSLIM_VERSION} saver unavailable: {exc!r}"
        ) from None


def _qconfig(dynamic: bool):
    """The ``qconfig`` of msModelSlim's own W8A8_DYNAMIC / W8A8 recipes."""
    from msmodelslim.core.quantizer.base import QConfig
    from msmodelslim.core.quantizer.linear import LinearQConfig

    weight = QConfig(scope="per_channel", dtype="int8", symmetric=True, method="minmax")
    if dynamic:
        act = QConfig(scope="per_token", dtype="int8", symmetric=True, method="minmax")
    else:
        act = QConfig(
            scope="per_tensor", dtype="int8", symmetric=False, method="minmax"
        )
    return LinearQConfig(act=act, weight=weight)


def _quantize_decoder_linears(model: torch.nn.Module, dynamic: bool) -> None:
    """Every decoder-layer linear of ``model`` quantized in place by msModelSlim's
    ``LinearQuantProcessor``: quantizers installed per layer, the model run over
    two calibration batches, the IR modules deployed."""
    from msmodelslim.core.base.protocol import BatchProcessRequest
    from msmodelslim.processor.quant.linear import (
        LinearProcessorConfig,
        LinearQuantProcessor,
    )

    config = LinearProcessorConfig(qconfig=_qconfig(dynamic), include=["*"])
    processor = LinearQuantProcessor(model, config)
    layers = [
        BatchProcessRequest(name=name, module=module)
        for name, module in model.named_modules()
        if name.rpartition(".")[0].endswith(".layers")
    ]
    for request in layers:
        processor.preprocess(request)
    generator = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=torch.randint(0, vocab, (2, 16), generator=generator))
    for request in layers:
        processor.postprocess(request)


def genuine_export(
    path: Path, model_dir: Path, *, quant_type: str = "W8A8", part_file_size: int = 4
) -> dict[str, Any]:
    """Run msModelSlim's ``AscendV1Saver`` (in a child process) on the checkpoint
    in ``model_dir`` with every decoder-layer linear quantized (``quant_type``
    ``W8A8`` static or ``W8A8_DYNAMIC``) and write its export to ``path``; returns
    the description it wrote. ``part_file_size`` (GB) is the saver's shard size
    (0: one file)."""
    proc = _child("export", str(path), str(model_dir), quant_type, str(part_file_size))
    if proc.returncode != 0:
        raise RuntimeError(f"msModelSlim's saver failed: {proc.stderr[-3000:]}")
    return json.loads((path / "quant_model_description.json").read_text())


def _export_here(
    path: Path, model_dir: Path, quant_type: str, part_file_size: int
) -> None:
    import transformers
    from msmodelslim.core.quant_service.modelslim_v1.save.ascendv1 import (
        AscendV1Config,
        AscendV1Saver,
    )
    from msmodelslim.core.quant_service.modelslim_v1.save.interface import (
        AscendV1GlobalModelDtypeInterface,
    )
    from msmodelslim.model import IModel

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16
    ).eval()
    _quantize_decoder_linears(model, quant_type == "W8A8_DYNAMIC")

    class Adapter(IModel, AscendV1GlobalModelDtypeInterface):
        model_type = str(model.config.model_type)
        model_path = Path(model_dir)
        trust_remote_code = False

        def get_global_model_torch_dtype(self) -> torch.dtype:
            return torch.bfloat16

    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o750)  # msModelSlim refuses group/other-writable outputs
    config = AscendV1Config(save_directory=str(path), part_file_size=part_file_size)
    saver = AscendV1Saver(model, config, Adapter())
    saver.pre_run()
    with torch.no_grad():
        saver.post_run()


if __name__ == "__main__":
    if sys.argv[1] == "check":
        _check_here()
    else:
        _, _, out, src, quant, size = sys.argv
        _export_here(Path(out), Path(src), quant, int(size))
