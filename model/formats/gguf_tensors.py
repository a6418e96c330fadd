"""GGUF tensors onto our weight forms, on their own codes wherever one of our kernels fits.

A GGUF matrix is stored row by row (one row per output, `ne[0]` inputs each), each row in
blocks along the inputs. The blocks we map exactly:

- Q4_1 (32 values: float16 d, m, 16 bytes of nibbles): W = d * q + m, our `Int4Array` as is.
- Q4_0 (float16 d, nibbles): W = d * (q - 8): an Int4Array with offset -8d (exact in float16).
- Q4_K (super-blocks of 256: float16 d and dmin, eight 6-bit scales and mins, nibbles):
  W = (d * sc) * q - dmin * mn per sub-block of 32, an Int4Array with float32 scales and
  offsets (products of a float16 and a 6-bit integer, exact in float32), float16 where exact.
- Q8_0 (float16 d, 32 int8 codes): W = d * q, our `Int8GroupArray` as is; an embedding
  table in Q8_0 stays in it too (its rows are looked up, and it is the tied head's weight).
- Q5_0 (float16 d, 32 high bits, nibbles): W = d * (q - 16), an Int8GroupArray whose codes
  are q - 16 (-16 .. 15), a table too.
- Q6_K (super-blocks of 256: 6-bit codes q, an int8 scale sc per sub-block of 16, float16
  d): W = (d * sc) * (q - 32), an Int8GroupArray in groups of 16 whose codes are q - 32
  (-32 .. 31) and whose scales are float32 (a float16 times an int8, exact in float32);
  a table too. Llama.cpp's Q4_K_M mix gives it the output head and about half of attn_v /
  ffn_down.
- F32 / F16 / BF16: float.

- Q3_K (super-blocks of 256: 2-bit low codes, a high-bit mask, 6-bit scales sc per
  sub-block of 16, float16 d): W = (d * (sc - 32)) * q with q in -4 .. 3, an
  Int8GroupArray in groups of 16 with float32 scales (exact: 11 + 6 bits).
- IQ4_NL (float16 d, 32 nibbles indexing 16 non-linear int8 levels): W = d * level, an
  Int8GroupArray whose codes are the levels. IQ4_XS (super-blocks of 256, float16 d and a
  6-bit scale ls per 32): W = (d * (ls - 32)) * level, float32 scales (11 + 6 + 7 bits: exact
  in float32's 24).

With a min per group, an Int8GroupArray with offsets (W = scale * code + offset; the product
is exact in float32, so the sum is the format's own, bit for bit):

- Q5_1 (32 values: float16 d and m, 32 high bits, nibbles): W = d * q + m, codes q (0 .. 31)
  with float16 scales d and offsets m; a table too.
- Q5_K (super-blocks of 256: float16 d and dmin, Q4_K's eight 6-bit scales and mins, 32
  bytes of high bits, nibbles): W = (d * sc) * q - dmin * mn per sub-block of 32, codes
  0 .. 31 with float32 scales d * sc and offsets -(dmin * mn) (11 + 6 bits each).
- Q2_K (super-blocks of 256: 16 bytes of 4-bit scales sc and mins mn, 2-bit codes, float16
  d and dmin): W = (d * sc) * q - dmin * mn per sub-block of 16, codes 0 .. 3 in groups of
  16 with float32 scales and offsets.

Every other type (the IQ types below 4 bits, TQ1_0, TQ2_0) is dequantized at load into
float32 by the `gguf` package, exactly as llama.cpp reads it; the start-up log names the
forms.
Nibble order in a 32-value block: value j < 16 in the low nibble of byte j, value j + 16 in
its high nibble. Q4_K's 64-value chunks hold sub-block 2c in the low nibbles and 2c + 1 in
the high ones. A Q6_K super-block is two halves of 128 values: half h's 64 bytes of ql hold
values 128h + b in their low nibbles and 128h + 64 + b in their high ones, its 32 bytes of
qh the two high bits of value 128h + 32i + j in bits 2i, 2i + 1 of byte j. Q5_K's nibbles
are Q4_K's, bit i of its qh byte j the fifth bit of value 32i + j. Q2_K's 64 bytes of codes
are two halves of 32: bits 2s, 2s + 1 of byte j in half c hold value 128c + 32s + j.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from model.formats.int_groups import f16_if_exact
from quant.int4 import Int4Array
from quant.int8_groups import Int8GroupArray

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q3_K,
                T.Q2_K, T.IQ4_NL, T.IQ4_XS)  # on int4 and 8-bit groups


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two little-endian bytes per value -> float16."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes in the block's value order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_blocks(data: np.ndarray, rows: int, cols: int, with_min: bool):
    """Q4_0 / Q4_1 rows -> (codes [rows, cols], d [rows, cols/32], m or None), each row's
    blocks in order."""
    size = 20 if with_min else 18
    blocks = data.reshape(rows, cols // 32, size)
    d = _f16(blocks[..., 0:2])
    m = _f16(blocks[..., 2:4]) if with_min else None
    codes = _nibbles32(blocks[..., size - 16:]).reshape(rows, cols)
    return codes, d, m


def _k_scales(packed: np.ndarray):
    """Q4_K / Q5_K's 12 bytes -> (8 scales, 8 mins), 6 bits each (llama.cpp's layout)."""
    q = packed.astype(np.uint8)
    sc = np.empty(q.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, mn


def _k_mins(blocks: np.ndarray, sc: np.ndarray, mn: np.ndarray, at: int, rows: int):
    """A K-quant super-block's float16 d and dmin (bytes at, at + 2) with its sub-blocks'
    scales and mins -> float32 (scale d * sc, offset -(dmin * mn)) [rows, sub-blocks]."""
    d = _f16(blocks[..., at:at + 2]).astype(np.float32)
    dmin = _f16(blocks[..., at + 2:at + 4]).astype(np.float32)
    return ((d[..., None] * sc).reshape(rows, -1),
            -(dmin[..., None] * mn).reshape(rows, -1))


def _q4_k_low(qs: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes of nibbles per super-block -> codes [rows, cols] (0 .. 15)."""
    qs = qs.reshape(rows, cols // 256, 4, 32)  # four chunks of 64 values
    return np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)


def _q4_k(data: np.ndarray, rows: int, cols: int):
    """Q4_K rows -> (codes [rows, cols], scale, offset float32 [rows, cols/32])."""
    blocks = data.reshape(rows, cols // 256, 144)
    scale, offset = _k_mins(blocks, *_k_scales(blocks[..., 4:16]), 0, rows)
    return _q4_k_low(blocks[..., 16:], rows, cols), scale, offset


def _q8_0(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """Q8_0 rows -> Int8GroupArray [rows, cols] with groups along the row (a table's form)."""
    blocks = data.reshape(rows, cols // 32, 34)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
    return Int8GroupArray(codes, _f16(blocks[..., 0:2]))


def _q5_codes(blocks: np.ndarray, at: int) -> np.ndarray:
    """A Q5_0 / Q5_1 block's codes q (0 .. 31) -> [..., 32] int16: bit j of the 32-bit qh at
    byte `at` is value j's fifth bit, the nibbles follow it."""
    high = np.ascontiguousarray(blocks[..., at:at + 4]).view("<u4")[..., 0]
    bits = ((high[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return (_nibbles32(blocks[..., at + 4:]) | (bits << 4)).astype(np.int16)


def _q5_0(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """Q5_0 rows -> Int8GroupArray [rows, cols] of codes q - 16."""
    blocks = data.reshape(rows, cols // 32, 22)
    codes = _q5_codes(blocks, 2) - 16
    return Int8GroupArray(codes.astype(np.int8).reshape(rows, cols), _f16(blocks[..., 0:2]))


def _q5_1(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """Q5_1 rows -> Int8GroupArray [rows, cols] of codes q with float16 scales d and offsets
    m (24-byte blocks: d, m, qh, nibbles)."""
    blocks = data.reshape(rows, cols // 32, 24)
    codes = _q5_codes(blocks, 4).astype(np.int8).reshape(rows, cols)
    return Int8GroupArray(codes, _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]))


def _q5_k(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """Q5_K rows -> Int8GroupArray [rows, cols] in groups of 32, codes 0 .. 31, float32
    scales d * sc and offsets -(dmin * mn) (176-byte super-blocks: d, dmin, 12 bytes of
    scales and mins, qh, nibbles)."""
    blocks = data.reshape(rows, cols // 256, 176)
    scale, offset = _k_mins(blocks, *_k_scales(blocks[..., 4:16]), 0, rows)
    high = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = _q4_k_low(blocks[..., 48:], rows, cols) | (high.reshape(rows, cols) << 4)
    return Int8GroupArray(codes.astype(np.int8), scale, offset)


def _q2_k(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """Q2_K rows -> Int8GroupArray [rows, cols] in groups of 16, codes 0 .. 3, float32
    scales d * sc and offsets -(dmin * mn) (84-byte super-blocks: 16 bytes of scales, sc
    in the low nibbles and mn in the high ones, 64 bytes of codes, d, dmin)."""
    blocks = data.reshape(rows, cols // 256, 84)
    sc, mn = blocks[..., :16] & 0x0F, blocks[..., :16] >> 4
    scale, offset = _k_mins(blocks, sc, mn, 80, rows)
    qs = blocks[..., 16:80].reshape(rows, -1, 2, 1, 32)  # [.., half, shift, byte]
    codes = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    return Int8GroupArray(codes.astype(np.int8).reshape(rows, cols), scale, offset)


def _q6_k(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """Q6_K rows -> Int8GroupArray [rows, cols] in groups of 16 along the row, codes q - 32
    and float32 scales d * sc (210-byte super-blocks: ql, qh, sc, d)."""
    blocks = data.reshape(rows, cols // 256, 210)
    ql = blocks[..., :128].reshape(rows, -1, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = (ql >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # [.., half, nibble, byte]
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # [.., half, i, byte]
    q = low.reshape(rows, -1, 256) | (high.reshape(rows, -1, 256) << 4)
    codes = (q.astype(np.int16) - 32).astype(np.int8).reshape(rows, cols)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210]).astype(np.float32)
    return Int8GroupArray(codes, (d[..., None] * sc).reshape(rows, cols // 16))


def _q3_k(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """Q3_K rows -> Int8GroupArray [rows, cols] in groups of 16, codes -4 .. 3 and float32
    scales d * (sc - 32) (110-byte super-blocks: hmask, qs, 12 bytes of 6-bit scales, d)."""
    blocks = data.reshape(rows, cols // 256, 110)
    hmask, qs, packed = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108]
    low = (qs.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    high = (hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = (low.reshape(rows, -1, 256).astype(np.int8)
             - ((1 - high.reshape(rows, -1, 256)) << 2).astype(np.int8))
    sc_low = (packed[..., None, 0:8] >> np.array([0, 4], np.uint8)[:, None]) & 0x0F
    sc_high = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    sc = (sc_low.reshape(rows, -1, 16) | (sc_high.reshape(rows, -1, 16) << 4)).astype(np.int8)
    d = _f16(blocks[..., 108:110]).astype(np.float32)
    scale = d[..., None] * (sc - np.int8(32)).astype(np.float32)
    return Int8GroupArray(codes.reshape(rows, cols), scale.reshape(rows, cols // 16))


# IQ4_NL / IQ4_XS's 16 non-linear levels (llama.cpp's kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                       113], np.int8)


def _iq4_nl(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """IQ4_NL rows -> Int8GroupArray [rows, cols]: codes are the levels the nibbles pick,
    the scale the block's float16 d (18-byte blocks of 32)."""
    blocks = data.reshape(rows, cols // 32, 18)
    codes = IQ4_LEVELS[_nibbles32(blocks[..., 2:])]
    return Int8GroupArray(codes.reshape(rows, cols), _f16(blocks[..., 0:2]))


def _iq4_xs(data: np.ndarray, rows: int, cols: int) -> Int8GroupArray:
    """IQ4_XS rows -> Int8GroupArray [rows, cols] in groups of 32: levels as IQ4_NL's,
    float32 scales d * (ls - 32) with 6-bit ls (136-byte super-blocks: d, the scales' two
    high bits each in a 16-bit word, their low nibbles in 4 bytes, 8 x 16 bytes of
    nibbles)."""
    blocks = data.reshape(rows, cols // 256, 136)
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")[..., 0]
    high = (high[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = (blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 0x0F
    ls = (low.reshape(rows, -1, 8) | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    d = _f16(blocks[..., 0:2]).astype(np.float32)
    codes = IQ4_LEVELS[_nibbles32(blocks[..., 8:].reshape(rows, -1, 8, 16))]
    scale = d[..., None] * ls.astype(np.float32)
    return Int8GroupArray(codes.reshape(rows, cols), scale.reshape(rows, cols // 32))


# read onto Int8GroupArray
GROUP8_TYPES = {T.Q8_0: _q8_0, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
                T.Q3_K: _q3_k, T.Q2_K: _q2_k, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs}


def tensor_form(data: np.ndarray, kind: T, shape: tuple[int, ...]):
    """One GGUF tensor (raw `data` as the reader gives it, `shape` in GGUF's order, inputs
    first) -> its value in our orientation: a matrix [in, out] as an Int4Array or float32
    array, a vector as float32."""
    if len(shape) == 1 or kind in FLOAT_TYPES or kind not in KERNEL_TYPES:
        w = np.asarray(dequantize(data, kind), np.float32).reshape(tuple(reversed(shape)))
        return w.T if w.ndim == 2 else w
    cols, rows = shape  # cols inputs per row, one row per output
    if kind in GROUP8_TYPES:
        return GROUP8_TYPES[kind](data, rows, cols).T  # [in, out], groups of inputs
    if kind == T.Q4_K:
        codes, scale, offset = _q4_k(data, rows, cols)
        scale, offset = f16_if_exact(scale), f16_if_exact(offset)
        if scale.dtype != offset.dtype:
            scale, offset = scale.astype(np.float32), offset.astype(np.float32)
    else:
        codes, d, m = _q4_blocks(data, rows, cols, with_min=kind == T.Q4_1)
        scale, offset = d, m if m is not None else d * np.float16(-8)
    return Int4Array(codes.T.astype(np.uint8), scale.T, offset.T)


def embedding(data: np.ndarray, kind: T, shape: tuple[int, ...]):
    """token_embd as our table [vocab, hidden]: the 8-bit group types (Q8_0, Q5_0, Q5_1,
    Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS) on their codes (an Int8GroupArray), every other
    type read exactly into float32."""
    if kind in GROUP8_TYPES:
        return GROUP8_TYPES[kind](data, shape[1], shape[0])
    return np.asarray(dequantize(data, kind), np.float32).reshape(tuple(reversed(shape)))


def permute_rows(value, perm: np.ndarray):
    """Output channels reordered (llama.cpp's Q/K permutation undone) in any of our forms:
    a kernel [in, out] or a bias [out]."""
    if isinstance(value, Int4Array):
        return Int4Array(value.values[:, perm], value.scale[:, perm], value.zero[:, perm])
    if isinstance(value, Int8GroupArray):
        return Int8GroupArray(*(None if a is None else a[:, perm]
                                for a in (value.values, value.scale, value.offset)))
    return value[..., perm]


def unpermute_order(rows: int, heads: int) -> np.ndarray:
    """The output-row order that undoes llama.cpp's rotary permutation of attn_q / attn_k:
    within each head it interleaves the two rotary halves (rows i and i + d/2 neighbours);
    Hugging Face keeps them apart."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)
