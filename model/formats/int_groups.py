"""Integer weight codes with per-group scales and zero points (GPTQ, AWQ, compressed-tensors'
pack-quantized, GGUF's K-quants) onto our forms, exactly.

The formats all mean, for input row i of a kernel [in, out] and its group g = g_idx[i]:

    W[i, o] = scale[g, o] * (code[i, o] - zero[g, o])        (computed exactly, in float32)

and we serve that as
- an `Int4Array` (quant/int4.py) when the codes are 4-bit and every aligned run of 32 rows
  shares one group: its scale is the group's and its offset `-scale * zero`, float16 where
  both are exact in float16, else float32 (the q4 kernel reads either);
- 8-bit codes whose zero point is the middle code (128), as values `code - 128`: an int8
  `QuantArray` per output channel when one group spans the whole input axis, else an
  `Int8GroupArray` (quant/int8_groups.py) when every aligned run of 32 rows shares a group;
- else float32, dequantized at load (the log's form names say so).
"""
from __future__ import annotations

import numpy as np

from quant.array import QuantArray
from quant.int4 import Int4Array
from quant.int8_groups import Int8GroupArray

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


def f16_if_exact(a: np.ndarray) -> np.ndarray:
    """float32 values as float16 where every one of them is exact in it, else as they are."""
    a = np.asarray(a)
    h = a.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), a, equal_nan=True) else a


def _aligned_groups(g: np.ndarray) -> np.ndarray | None:
    """Each run of 32 input rows' group when every such run lies in one group, else None."""
    k = g.shape[0]
    if k % GROUP:
        return None
    blocks = g.reshape(k // GROUP, GROUP)
    return blocks[:, 0] if (blocks == blocks[:, :1]).all() else None


def _short_mantissas(scale: np.ndarray) -> bool:
    """Whether every scale has at most 20 significant bits (every float16 or bfloat16 one
    does): then scale * code and scale * zero (4-bit integers) are exact in float32, and so
    is their difference, scale * (code - zero)."""
    return bool((np.ascontiguousarray(scale, np.float32).view(np.uint32) & 0xF == 0).all())


def to_our_form(codes, scale, zero, bits: int, g_idx=None):
    """codes: unsigned integers [in, out] (0 .. 2**bits - 1); scale: float [G, out]; zero:
    the zero point per group [G, out] (integers or floats, in code units) -> Int4Array,
    QuantArray, Int8GroupArray or float32 array standing for the same weight, bit for bit."""
    codes = np.asarray(codes)
    scale32 = np.asarray(scale, np.float32)
    zero32 = np.broadcast_to(np.asarray(zero, np.float32), scale32.shape)
    if not np.array_equal(zero32, np.round(zero32)):
        raise ValueError("zero points are whole codes in these formats")
    g = row_groups(codes.shape[0], scale32.shape[0], g_idx)
    runs = _aligned_groups(g)
    if bits == 4 and runs is not None and _short_mantissas(scale32):
        s = scale32[runs]
        m = -s * zero32[runs]  # exact, as is scale * code + m (see _short_mantissas)
        s, m = f16_if_exact(s), f16_if_exact(m)
        if s.dtype != m.dtype:
            s, m = s.astype(np.float32), m.astype(np.float32)
        return Int4Array(codes.astype(np.uint8), s, m)
    if bits == 8 and (zero32 == 128).all():
        signed = (codes.astype(np.int16) - 128).astype(np.int8)
        if scale32.shape[0] == 1:
            return QuantArray(signed, scale32)
        if runs is not None:
            return Int8GroupArray(signed, f16_if_exact(scale32[runs]))
    return dequantize_groups(codes, scale32, zero32, g_idx)
