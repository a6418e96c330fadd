"""Checkpoint formats beyond our own and plain Hugging Face folders: which one a folder holds,
and the loader that maps it onto our weight forms (docs/architecture.md, "Checkpoint formats").

A Hugging Face folder is pre-quantized when its config.json has a `quantization_config` (or
the folder has AutoGPTQ's `quantize_config.json`); its `quant_method` picks the module here.
A GGUF file is read through model/formats/gguf_file.py, which gives it a folder of its own.
"""
from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

from model.config import ModelConfig
from model.hf_weights import WeightsError

_log = logging.getLogger("xlaserve")

# quant_method -> (module under model/formats, the name the log gives the format)
QUANT_METHODS = {
    "compressed-tensors": ("compressed_tensors", "compressed-tensors"),
    "gptq": ("gptq", "GPTQ"),
    "awq": ("awq", "AWQ"),
    "fp8": ("fp8_blocks", "fp8 with block scales"),
}
# Read by the float loader, dequantized as they load (model/formats/mxfp4.py); a recipe may
# quantize them again.
DEQUANTIZED_METHODS = ("mxfp4",)
# what --quantize may name for a checkpoint quantized on disk (it must be its own)
PREQUANTIZED_METHODS = (*QUANT_METHODS, *DEQUANTIZED_METHODS, "gguf")


class FormatError(WeightsError):
    """A checkpoint in a format (or with a setting) we do not serve."""


def quantization_config(folder: str | Path) -> dict | None:
    """The folder's quantization config, or None for a float checkpoint."""
    folder = Path(folder)
    config = folder / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    qc = hf.get("quantization_config")
    if qc is None and (folder / "quantize_config.json").is_file():
        qc = json.loads((folder / "quantize_config.json").read_text())
        qc.setdefault("quant_method", "gptq")
    if qc is None:
        return None
    if not isinstance(qc, dict) or "quant_method" not in qc:
        raise FormatError(f"{folder}: quantization_config has no quant_method")
    return qc


def check_requested(qc: dict, quantize: str | None, folder: Path) -> None:
    """vLLM's rule: a quantization named for a pre-quantized checkpoint must be its own."""
    if quantize and quantize != qc["quant_method"]:
        raise FormatError(f"{folder} is already quantized (quant_method "
                          f"{qc['quant_method']!r}); --quantize {quantize} does not agree with "
                          "it: leave --quantize out, or pass the checkpoint's own method")


def load_prequantized(folder: Path, cfg: ModelConfig, qc: dict) -> tuple[dict, list[str]]:
    """-> (numpy parameter tree in our forms, log lines naming the format and the forms)."""
    from model.formats.quantized_folder import load_quantized_folder
    method = qc["quant_method"]
    if method not in QUANT_METHODS:
        raise FormatError(f"unsupported quantization_config.quant_method {method!r}; "
                          f"supported: {', '.join(QUANT_METHODS)}")
    module_name, describe = QUANT_METHODS[method]
    module = importlib.import_module(f"model.formats.{module_name}")
    reader = module.make_reader(qc, cfg)  # raises FormatError naming an unsupported field
    return load_quantized_folder(folder, cfg, reader, describe)


def _is_recipe(spec: str) -> bool:
    """Whether --quantize names a recipe to quantize with at load ("fp8" is both)."""
    from quant.recipe import Recipe
    try:
        Recipe.parse(spec)
    except ValueError:
        return False
    return True


def load_folder(folder: Path, cfg: ModelConfig, quantize: str | None) -> dict | None:
    """A pre-quantized folder's (or a GGUF's) numpy parameter tree, its forms logged; None
    for a float Hugging Face folder, which model/hf_weights.py reads (MXFP4 experts too,
    dequantized there)."""
    from model.formats import gguf_file
    if gguf_file.is_gguf_folder(folder):
        params, log = gguf_file.load_gguf_weights(folder, cfg, quantize)
    else:
        qc = quantization_config(folder)
        if qc is None:
            if quantize in PREQUANTIZED_METHODS and not _is_recipe(quantize):
                raise FormatError(f"--quantize {quantize} names a checkpoint format, but "
                                  f"{folder} holds no quantization_config: leave it out, or "
                                  "name a recipe (int8, int4, fp8) to quantize as it loads")
            return None
        if qc["quant_method"] in DEQUANTIZED_METHODS:
            from model.formats import mxfp4
            mxfp4.check(qc, cfg, folder)
            if quantize and quantize != "mxfp4" and not _is_recipe(quantize):
                check_requested(qc, quantize, folder)
            _log.info("MXFP4 experts dequantized to %s as they load%s", cfg.dtype,
                      f", then quantized by {quantize}" if _is_recipe(quantize or "") else "")
            return None
        check_requested(qc, quantize, folder)
        params, log = load_prequantized(folder, cfg, qc)
    for line in log:
        _log.info("%s", line)
    return params
