"""Weights quantized as they load, saved so a restart reads them back instead of loading the
stored precision and quantizing again (the demo's default, int4 layers and an int8 head from
its float32 checkpoint, spent seconds of every start there).

One file per (checkpoint folder, recipe, dtype), `<slot>.xlw` under the cache folder the
executables use: a header (what the weights were made from: the checkpoint's files with
their sizes and modification times, the recipe, the dtype, the code version and jax's), the
pytree's structure and each leaf's dtype, shape and place, then the leaves' bytes. A header
that does not match (the checkpoint rewritten, other code) or a file that cannot be read is
logged and the weights are quantized again and the file rewritten: never a crash, never
stale weights. Only xlaserve checkpoints stored unquantized are cached, and only up to
MAX_BYTES of quantized weights (a large model's copy is not written behind the user's back);
the folder is kept under MAX_BYTES by removing the least recently used files.

Loading runs code from the file (pickle), so the folder must be as trusted as the code, as
for the executables."""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import jax
import numpy as np

from model.checkpoint import is_checkpoint, read_metadata
from quant.recipe import from_metadata
from serving.engine.executable_cache import code_version

log = logging.getLogger("xlaserve")

MAGIC = b"XLASERVE-WEIGHTS\x01"
SUFFIX = ".xlw"
MAX_BYTES = 2 << 30
ALIGN = 64


def cacheable(model_dir: Path, quantize: str | None) -> bool:
    """Quantized at load: an xlaserve checkpoint stored in float, with a recipe asked."""
    return bool(quantize) and is_checkpoint(model_dir) and \
        from_metadata(read_metadata(model_dir).get("quantization")) is None


def identity(model_dir: Path, quantize: str, dtype: str | None) -> dict:
    """What the weights are made from; a file whose header differs is stale."""
    files = sorted((str(p.relative_to(model_dir)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in Path(model_dir).rglob("*") if p.is_file())
    return dict(model=str(Path(model_dir).resolve()), files=files, quantize=quantize,
                dtype=dtype, code=code_version(), jax=jax.__version__)


def slot(root: Path, model_dir: Path, quantize: str, dtype: str | None) -> Path:
    name = f"{Path(model_dir).resolve()}|{quantize}|{dtype}"
    return Path(root) / (hashlib.sha256(name.encode()).hexdigest()[:32] + SUFFIX)


def load(path: Path, expected: dict):
    """(ModelConfig, the saved tree of jax arrays), or None (missing, stale or unreadable:
    logged)."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a weights file")
            header_size = int.from_bytes(f.read(8), "little")
            header = pickle.loads(f.read(header_size))
            if header["identity"] != expected:
                log.info("weights cache %s was made from other files or code: quantizing again",
                         path.name)
                return None
            f.seek(-(-f.tell() // ALIGN) * ALIGN)
            # read into memory of our own: arrays never alias a file that may be replaced
            data = np.empty(max((o + n for _, _, o, n in header["leaves"]), default=0), np.uint8)
            if f.readinto(data) != data.size:
                raise ValueError("the file is cut short")
        leaves = [jax.numpy.asarray(data[offset:offset + nbytes].view(jax.numpy.dtype(dtype))
                                    .reshape(shape))
                  for dtype, shape, offset, nbytes in header["leaves"]]
        os.utime(path)  # recently used: the last to be removed
        return header["config"], jax.tree_util.tree_unflatten(header["treedef"], leaves)
    except Exception as e:  # noqa: BLE001 - a broken file means quantizing again
        log.warning("weights cache %s unreadable (%s: %s): quantizing again", path.name,
                    type(e).__name__, e)
        return None


def save(path: Path, identity_: dict, cfg, params) -> bool:
    """Writes the tree (atomically); False when it is over MAX_BYTES or cannot be written."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    arrays = [np.asarray(a) for a in leaves]
    total = sum(a.nbytes for a in arrays)
    if total > MAX_BYTES:
        log.info("weights cache: %.1f GiB of quantized weights is over %.0f GiB, not saved",
                 total / 2**30, MAX_BYTES / 2**30)
        return False
    table, offset = [], 0
    for a in arrays:
        table.append((a.dtype.name, a.shape, offset, a.nbytes))
        offset += -(-a.nbytes // ALIGN) * ALIGN
    header = pickle.dumps(dict(identity=identity_, config=cfg, treedef=treedef, leaves=table))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            start = -(-f.tell() // ALIGN) * ALIGN
            for a, (_, _, place, _) in zip(arrays, table):
                f.seek(start + place)
                f.write(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes())
            tmp = f.name
        os.replace(tmp, path)
        _prune(path.parent, keep=path)
        return True
    except OSError as e:
        log.warning("weights cache: could not write %s (%s)", path, e)
        return False


def _prune(folder: Path, keep: Path) -> None:
    """Removes the least recently used files until the folder holds at most MAX_BYTES."""
    files = sorted(folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    for old in files:
        if total <= MAX_BYTES:
            break
        if old != keep:
            total -= old.stat().st_size
            old.unlink(missing_ok=True)
            log.info("weights cache: removed %s (least recently used)", old.name)
