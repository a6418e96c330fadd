"""Our checkpoint folder: an orbax parameter tree plus config, tokenizer and metadata.

Layout: config.json (HF's), tokenizer and generation files, `xlaserve.json` (metadata, written
last, so a folder without it is not a checkpoint) and `params/` (orbax).
A model folder is either such a checkpoint or a Hugging Face folder read directly.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from model import formats
from model.config import ModelConfig
from model.hf_weights import abstract_params, load_hf_params, np_dtype
from quant.int4 import is_quantized
from quant.recipe import Recipe, abstract_quantized, from_metadata, quantize_params

METADATA = "xlaserve.json"
FORMAT_VERSION = 1
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
              "added_tokens.json", "chat_template.jinja", "chat_template.json")


class CheckpointError(ValueError):
    pass


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / METADATA).is_file()


def read_metadata(path: str | Path) -> dict:
    return json.loads((Path(path) / METADATA).read_text())


def convert_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
               progress: bool = True, quantize: str | None = None) -> dict:
    """HF folder -> checkpoint folder. Writes into a temporary sibling, renamed at the end,
    so a failure never leaves a folder that looks valid. Returns the metadata.
    quantize: a recipe spec ("int8", "fp8", see quant/recipe.py), stored in the metadata."""
    recipe = Recipe.parse(quantize) if quantize else None
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"model folder {hf_dir} does not exist")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"output folder {out_dir} already exists and is not empty")
    cfg = ModelConfig.from_dir(hf_dir, dtype)
    started = time.perf_counter()
    params = load_hf_params(hf_dir, cfg, progress)
    bf16_bytes = 2 * sum(a.size for a in jax.tree.leaves(params))  # to compare sizes with
    if recipe:
        params = quantize_params(params, recipe)
    weight_bytes = param_bytes(params)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        import orbax.checkpoint as ocp  # imported where used (0.4 s a warm start skips)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save((tmp / "params").resolve(), params)
            ckptr.wait_until_finished()
        del params
        for name in SIDE_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, tmp / name)
        meta = {"format": "xlaserve", "version": FORMAT_VERSION, "source": str(hf_dir.resolve()),
                "dtype": cfg.dtype, "quantization": recipe.to_dict() if recipe else "none",
                "weight_bytes": weight_bytes, "bf16_bytes": bf16_bytes,
                "model_config": cfg.to_dict(),
                "convert_seconds": round(time.perf_counter() - started, 2)}
        (tmp / METADATA).write_text(json.dumps(meta, indent=2))
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def load_model(path: str | Path, dtype: str | None = None, progress: bool = True,
               quantize: str | None = None):
    """Model folder (checkpoint or HF) -> (ModelConfig, params on the default device).

    quantize: a recipe spec to quantize an unquantized model with as it loads. A quantized
    checkpoint loads as stored (quantize, if given, must name its recipe)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    if not is_checkpoint(path):
        cfg = ModelConfig.from_dir(path, dtype)
        prequantized = formats.load_folder(path, cfg, quantize)
        if prequantized is not None:
            return cfg, jax.tree.map(jax.numpy.asarray, prequantized)
        params = load_hf_params(path, cfg, progress)
        if quantize and quantize not in formats.DEQUANTIZED_METHODS:
            params = quantize_params(params, quantize)
        return cfg, jax.tree.map(jax.numpy.asarray, params)
    meta = read_metadata(path)
    if meta.get("format") != "xlaserve" or meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path / METADATA} is not an xlaserve checkpoint of version "
                              f"{FORMAT_VERSION}")
    stored = ModelConfig.from_dict(meta["model_config"])
    recipe = from_metadata(meta.get("quantization"))
    if quantize and recipe and recipe != Recipe.parse(quantize):
        raise CheckpointError(f"{path} is already quantized ({recipe.spec}); load it without "
                              f"quantize={quantize!r}, or convert the original again")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np_dtype(stored.dtype)),
                            abstract_params(stored))
    if recipe:
        abstract = abstract_quantized(abstract, recipe)
    # With a sharding, orbax restores straight into device arrays rather than numpy: on
    # the default device (a data-parallel replica's own, serving/engine/data_parallel.py).
    device = jax.sharding.SingleDeviceSharding(jax.config.jax_default_device
                                               or jax.local_devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            abstract)
    import orbax.checkpoint as ocp  # imported where used (0.4 s a warm start skips)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore((path / "params").resolve(), abstract)
    if quantize and not recipe:  # from the stored precision, before any dtype change
        params = quantize_params(params, quantize)
    cfg = stored.with_dtype(dtype) if dtype else stored
    if cfg.dtype != stored.dtype:  # quantized weights stay as they are
        params = jax.tree.map(
            lambda a: a if is_quantized(a) else a.astype(np_dtype(cfg.dtype)),
            params, is_leaf=is_quantized)
    return cfg, params


def param_bytes(params) -> int:
    """Bytes the leaves hold (uint4 codes two a byte)."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize // (2 if a.dtype == jnp.uint4 else 1)
               for a in jax.tree.leaves(params))
