"""Where a GGUF file's tensors lie, written once into its folder's gguf.json so that every
later load maps the tensors straight from the file.

The `gguf` package's reader parses every metadata field before it finds a tensor: a
tokenizer of 49,152 tokens and their merges took 6.8 s of a warm start's 8.5 s of weights.
The folder's config.json and tokenizer already hold what the metadata says, so a load needs
only each tensor's name, type, shape and byte range: `index` records them when the folder
is made, `tensors` memory-maps the files and cuts them out, as the reader would give them.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import quant_shape_to_byte_shape

# element types the reader returns as numbers; every other type comes as its bytes
_NUMERIC = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8,
            T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}


@dataclass
class Tensor:
    name: str
    tensor_type: T
    shape: tuple[int, ...]  # GGUF's order: inputs first
    data: np.ndarray  # as GGUFReader gives it: numbers, or [rows, bytes of a row]


def index(readers) -> list[list]:
    """[file number, name, type, shape, byte offset, byte count] of every tensor."""
    return [[i, t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset),
             int(t.n_bytes)] for i, r in enumerate(readers) for t in r.tensors]


def tensors(files: list[Path], entries: list[list]) -> Iterator[Tensor]:
    """The tensors `entries` (from `index`) name, mapped from `files`; a tensor past its
    file's end raises ValueError."""
    maps = [np.memmap(f, np.uint8, mode="r") for f in files]
    for file_number, name, kind, shape, offset, nbytes in entries:
        kind = T(kind)
        raw = maps[file_number][offset:offset + nbytes]
        if raw.size != nbytes or nbytes != _nbytes(kind, shape):
            raise ValueError(f"tensor {name!r} lies past the end of {files[file_number]}")
        dims = tuple(reversed(shape))
        data = (raw.view(_NUMERIC[kind]).reshape(dims) if kind in _NUMERIC
                else raw.reshape(quant_shape_to_byte_shape(dims, kind)))
        yield Tensor(name, kind, tuple(shape), data)


def _nbytes(kind: T, shape: list[int]) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return int(np.prod(shape)) * size // block
