"""Writers of the GGUF block types the `gguf` package only reads (K-quants, IQ4): plain
round-to-nearest encodings in llama.cpp's byte layouts, good enough for tiny test models
(the loader's oracle is the package's own dequantization of whatever bytes are written).

    blocks = ENCODERS[T.Q3_K](w)   # float [..., cols] -> uint8 [..., cols / 256 * 110]
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from model.formats.gguf_tensors import IQ4_LEVELS


def _blocks(w: np.ndarray, size: int, group: int) -> np.ndarray:
    """float [..., cols] -> float32 [rows, cols / size, size / group, group]."""
    cols = w.shape[-1]
    return np.asarray(w, np.float32).reshape(-1, cols // size, size // group, group)


def _divide(a, b):
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32),
                     where=b != 0)


def _signed_max(b: np.ndarray) -> np.ndarray:
    """Each group's value of largest magnitude, with its sign: [..., group] -> [...]."""
    at = np.abs(b).argmax(-1)[..., None]
    return np.take_along_axis(b, at, -1)[..., 0]


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: ql, qh, int8 sub-block scales, float16 d (210 bytes per 256), each sub-block
    of 16 scaled to its largest value."""
    *lead, cols = w.shape
    b = _blocks(w, 256, 16)
    sub = np.abs(b).max(-1) / 31  # [rows, blocks, 16]
    d = (sub.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(_divide(sub, d.astype(np.float32)[..., None])), 0, 127).astype(np.int8)
    q = np.round(_divide(b, (d.astype(np.float32)[..., None] * sc)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(*b.shape[:2], 2, 128)  # halves
    lo, hi = q & 0x0F, (q >> 4).reshape(*b.shape[:2], 2, 4, 32)
    ql = lo[..., :64] | (lo[..., 64:] << 4)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    blocks = np.concatenate([ql.reshape(*b.shape[:2], 128), qh.reshape(*b.shape[:2], 64),
                             sc.view(np.uint8), d.view(np.uint8).reshape(*b.shape[:2], 2)],
                            axis=-1)
    return blocks.reshape(*lead, cols // 256 * 210)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """Q3_K: hmask, 2-bit codes, 6-bit scales, float16 d (110 bytes per 256); codes -4 .. 3,
    each sub-block of 16 scaled so its largest magnitude is 4."""
    *lead, cols = w.shape
    b = _blocks(w, 256, 16)
    sub = -_signed_max(b) / 4  # [rows, blocks, 16]: the largest value lands on code -4
    d = (np.abs(sub).max(-1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(_divide(sub, d32)), -32, 31).astype(np.int8)
    q = np.clip(np.round(_divide(b, (d32 * sc)[..., None])), -4, 3).astype(np.int8)
    q = q.reshape(*b.shape[:2], 256)
    low = (q & 3).astype(np.uint8).reshape(*b.shape[:2], 2, 4, 32)  # [half, shift, byte]
    qs = low[..., 0, :] | (low[..., 1, :] << 2) | (low[..., 2, :] << 4) | (low[..., 3, :] << 6)
    high = (q >= 0).astype(np.uint8).reshape(*b.shape[:2], 8, 32)  # bit i: values 32i + j
    hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[:, None], axis=-2)
    u = (sc + 32).astype(np.uint8)  # 0 .. 63
    packed = np.concatenate([(u[..., 0:8] & 0x0F) | ((u[..., 8:16] & 0x0F) << 4),
                             (u[..., 0:4] >> 4) | ((u[..., 4:8] >> 4) << 2)
                             | ((u[..., 8:12] >> 4) << 4) | ((u[..., 12:16] >> 4) << 6)],
                            axis=-1)
    blocks = np.concatenate([hmask, qs.reshape(*b.shape[:2], 64), packed,
                             d.view(np.uint8).reshape(*b.shape[:2], 2)], axis=-1)
    return blocks.reshape(*lead, cols // 256 * 110)


def _with_mins(b: np.ndarray, top: int, sub_top: int):
    """Sub-blocks b [rows, blocks, subs, size] as W = (d * sc) * q - dmin * mn, the
    sub-block's minimum (or 0) on code 0 and its maximum on code `top`, sc and mn in
    0 .. sub_top -> (d, dmin float16 [rows, blocks], sc, mn uint8 [.., subs], q uint8)."""
    low = np.minimum(b.min(-1), 0)
    step, floor = (b.max(-1) - low) / top, -low
    d = (step.max(-1) / sub_top).astype(np.float16)
    dmin = (floor.max(-1) / sub_top).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(_divide(step, d32)), 0, sub_top).astype(np.uint8)
    mn = np.clip(np.round(_divide(floor, dmin32)), 0, sub_top).astype(np.uint8)
    q = _divide(b + (dmin32 * mn)[..., None], (d32 * sc)[..., None])
    return d, dmin, sc, mn, np.clip(np.round(q), 0, top).astype(np.uint8)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Q5_K: float16 d and dmin, 6-bit scales and mins packed as Q4_K's, qh, nibbles (176
    bytes per 256), codes 0 .. 31 per sub-block of 32."""
    *lead, cols = w.shape
    b = _blocks(w, 256, 32)
    d, dmin, sc, mn, q = _with_mins(b, 31, 63)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                             mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], axis=-1)
    q = q.reshape(*b.shape[:2], 8, 32)  # value 32i + j
    qh = np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=-2)
    low = (q & 0x0F).reshape(*b.shape[:2], 4, 2, 32)  # chunks of 64: low, high nibbles
    qs = low[..., 0, :] | (low[..., 1, :] << 4)
    blocks = np.concatenate([d.view(np.uint8).reshape(*b.shape[:2], 2),
                             dmin.view(np.uint8).reshape(*b.shape[:2], 2), packed, qh,
                             qs.reshape(*b.shape[:2], 128)], axis=-1)
    return blocks.reshape(*lead, cols // 256 * 176)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """Q2_K: 4-bit scales and mins (sc low nibble, mn high), 2-bit codes, float16 d and dmin
    (84 bytes per 256), codes 0 .. 3 per sub-block of 16."""
    *lead, cols = w.shape
    b = _blocks(w, 256, 16)
    d, dmin, sc, mn, q = _with_mins(b, 3, 15)
    q = q.reshape(*b.shape[:2], 2, 4, 32)  # [half, shift, byte]
    qs = q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)
    blocks = np.concatenate([sc | (mn << 4), qs.reshape(*b.shape[:2], 64),
                             d.view(np.uint8).reshape(*b.shape[:2], 2),
                             dmin.view(np.uint8).reshape(*b.shape[:2], 2)], axis=-1)
    return blocks.reshape(*lead, cols // 256 * 84)


def _levels(x: np.ndarray) -> np.ndarray:
    """Values in units of the scale -> the index of the nearest IQ4 level."""
    return np.abs(x[..., None] - IQ4_LEVELS.astype(np.float32)).argmin(-1).astype(np.uint8)


def _nibbles(idx: np.ndarray) -> np.ndarray:
    """[..., 32] level indices -> [..., 16] bytes (value j low, j + 16 high)."""
    return idx[..., :16] | (idx[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """IQ4_NL: float16 d and 16 bytes of level indices per 32 values."""
    *lead, cols = w.shape
    b = _blocks(w, 32, 32)[..., 0, :]
    d = (-_signed_max(b) / 127).astype(np.float16)  # the largest value on level -127
    idx = _levels(_divide(b, d.astype(np.float32)[..., None]))
    blocks = np.concatenate([d.view(np.uint8).reshape(*b.shape[:2], 2), _nibbles(idx)], -1)
    return blocks.reshape(*lead, cols // 32 * 18)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """IQ4_XS: float16 d, 6-bit scales per 32 (high bits in a 16-bit word, low nibbles in 4
    bytes), level indices (136 bytes per 256)."""
    *lead, cols = w.shape
    b = _blocks(w, 256, 32)
    sub = -_signed_max(b) / 127  # [rows, blocks, 8]
    d = (np.abs(sub).max(-1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    ls = np.clip(np.round(_divide(sub, d32)), -32, 31).astype(np.int8)
    idx = _levels(_divide(b, (d32 * ls)[..., None]))
    u = (ls + 32).astype(np.uint8)
    low = (u[..., 0::2] & 0x0F) | ((u[..., 1::2] & 0x0F) << 4)
    high = np.bitwise_or.reduce((u >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16)),
                                axis=-1)
    blocks = np.concatenate([d.view(np.uint8).reshape(*b.shape[:2], 2),
                             high.astype("<u2")[..., None].view(np.uint8), low,
                             _nibbles(idx).reshape(*b.shape[:2], 128)], axis=-1)
    return blocks.reshape(*lead, cols // 256 * 136)


ENCODERS = {T.Q6_K: quantize_q6_k, T.Q3_K: quantize_q3_k, T.Q5_K: quantize_q5_k,
            T.Q2_K: quantize_q2_k, T.IQ4_NL: quantize_iq4_nl, T.IQ4_XS: quantize_iq4_xs}
