"""Integer weight codes with per-group scales and zero points (GPTQ, AWQ, compressed-tensors'
pack-quantized, GGUF's K-quants) onto our forms, exactly.

The formats all mean, for input row i of a kernel [in, out] and its group g = g_idx[i]:

    W[i, o] = scale[g, o] * (code[i, o] - zero[g, o])        (computed exactly, in float32)

and we serve that as
- an `Int4Array` (quant/int4.py) when the codes are 4-bit and every aligned run of 32 rows
  shares one group: its scale is the group's and its offset `-scale * zero`, float16 where
  both are exact in float16, else float32 (the q4 kernel reads either);
- an int8 `QuantArray` per output channel when the codes are 8-bit, one group spans the
  whole input axis and the zero point is the middle code (128): values `code - 128`;
- else float32, dequantized at load (the log's form names say so).
"""
from __future__ import annotations

import numpy as np

from quant.array import QuantArray
from quant.int4 import Int4Array

GROUP = 32  # rows per Int4Array scale


def row_groups(num_rows: int, num_groups: int, g_idx: np.ndarray | None) -> np.ndarray:
    """Each input row's group: g_idx when given (act-order), else contiguous groups."""
    if g_idx is not None:
        g_idx = np.asarray(g_idx).astype(np.int64).reshape(-1)
        if g_idx.shape != (num_rows,) or g_idx.min() < 0 or g_idx.max() >= num_groups:
            raise ValueError(f"g_idx of shape {g_idx.shape} with groups up to "
                             f"{g_idx.max()} does not fit {num_rows} rows in {num_groups} "
                             "groups")
        return g_idx
    if num_rows % num_groups:
        raise ValueError(f"{num_rows} input rows do not split into {num_groups} groups")
    return np.arange(num_rows) // (num_rows // num_groups)


def dequantize_groups(codes, scale, zero, g_idx=None) -> np.ndarray:
    """The formats' own dequantization, in float32: codes [in, out], scale / zero [G, out]."""
    codes = np.asarray(codes)
    g = row_groups(codes.shape[0], scale.shape[0], g_idx)
    s = np.asarray(scale, np.float32)[g]
    z = np.asarray(zero, np.float32)[g]
    return s * (codes.astype(np.float32) - z)


def _f16_if_exact(a: np.ndarray) -> np.ndarray:
    h = a.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), a, equal_nan=True) else a


def to_our_form(codes, scale, zero, bits: int, g_idx=None):
    """codes: unsigned integers [in, out] (0 .. 2**bits - 1); scale: float [G, out]; zero:
    the zero point per group [G, out] (integers or floats, in code units) -> Int4Array,
    QuantArray or float32 array standing for the same weight, bit for bit."""
    codes = np.asarray(codes)
    k, n = codes.shape
    scale32 = np.asarray(scale, np.float32)
    zero32 = np.broadcast_to(np.asarray(zero, np.float32), scale32.shape)
    if not np.array_equal(zero32, np.round(zero32)):
        raise ValueError("zero points are whole codes in these formats")
    g = row_groups(k, scale32.shape[0], g_idx)
    if bits == 4 and k % GROUP == 0:
        blocks = g.reshape(k // GROUP, GROUP)
        if (blocks == blocks[:, :1]).all():
            s = scale32[blocks[:, 0]]
            m = -s * zero32[blocks[:, 0]]  # exact: a float16 scale times a small integer
            s, m = _f16_if_exact(s), _f16_if_exact(m)
            if s.dtype != m.dtype:
                s, m = s.astype(np.float32), m.astype(np.float32)
            return Int4Array(codes.astype(np.uint8), s, m)
    if (bits == 8 and scale32.shape[0] == 1 and (zero32 == 128).all()):
        return QuantArray((codes.astype(np.int16) - 128).astype(np.int8), scale32)
    return dequantize_groups(codes, scale32, zero32, g_idx)
