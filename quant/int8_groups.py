"""Int8GroupArray: 8-bit codes with one scale per group of g values along the axis a weight
is summed over: g = 32 for GGUF's Q8_0 form (and the grouped 8-bit checkpoints mapped onto
it), g = 16 for GGUF's Q6_K (codes q - 32, a scale per sub-block of 16).

A kernel [in, out] groups its inputs; an embedding table [V, H] groups H, the inputs of the
tied head it also is:

    kernel: W[k, n] = scale[k // g, n] * values[k, n] (+ offset[k // g, n])
    table:  E[v, h] = scale[v, h // g] * values[v, h] (+ offset[v, h // g])

with scale and offset [..., in // g, out] (kernel) or [..., V, H // g] (table). The offset,
a group's min, is for the formats that store one (GGUF's Q5_1, Q5_K, Q2_K); it is None
elsewhere. The shapes say which (`group_axis`) and how long a group is (`group`): one axis of
the scale is g times shorter than the values', the other the same. Scales are float16 (Q8_0's
own) or float32 where a format's scale is not exact in float16; an offset has its scale's
dtype. `.T` turns a table into its head kernel.

Dequantized, a value is its code times the scale, then plus the offset, in float32. For the
GGUF formats with mins the product is exact in float32 (a scale of at most 11 + 6
significant bits times a code of at most 5), so a product and a sum contracted into one FMA
round the same: the format's own `d * q + m`, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from quant.array import ValuesShaped

GROUP = 32  # values per scale along the summed axis, as `quantize_int8_groups` makes them
QMAX = 127


@jax.tree_util.register_dataclass
@dataclass
class Int8GroupArray(ValuesShaped):
    values: jax.Array  # int8 [..., A, B]
    scale: jax.Array  # float16 | float32: [..., A // g, B] (kernel) or [..., A, B // g] (table)
    offset: jax.Array | None = None  # the scale's shape and dtype: a group's min, or None

    @property
    def scheme(self) -> str:
        return "int8"

    @property
    def group_axis(self) -> int:
        """-2 for a kernel (groups of inputs), -1 for a table (groups of a row)."""
        return -2 if self.scale.shape[-1] == self.values.shape[-1] else -1

    @property
    def group(self) -> int:
        """Values per scale along the grouped axis: 32 (Q8_0, Q5_0, Q5_1, Q5_K) or 16 (Q6_K,
        Q3_K, Q2_K)."""
        axis = self.group_axis
        return self.values.shape[axis] // self.scale.shape[axis]

    @property
    def T(self) -> "Int8GroupArray":
        """The last two axes swapped: a table [V, H] becomes the head kernel [H, V]."""
        return Int8GroupArray(*(None if a is None else a.swapaxes(-1, -2)
                                for a in (self.values, self.scale, self.offset)))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_int8_groups(self, dtype)


def expand_scale(scale, group: int, axis: int):
    """A group scale repeated over its `group` values along `axis`."""
    return jnp.repeat(scale, group, axis=axis)


def dequantize_int8_groups(q: Int8GroupArray, dtype=jnp.float32) -> jax.Array:
    s = expand_scale(q.scale.astype(jnp.float32), q.group, q.group_axis)
    w = q.values.astype(jnp.float32) * s
    if q.offset is not None:
        w = w + expand_scale(q.offset.astype(jnp.float32), q.group, q.group_axis)
    return w.astype(dtype)


def quantize_int8_groups(x) -> Int8GroupArray:
    """float[..., in, out] -> a kernel in Q8_0's form: per group, scale = amax / 127 rounded to
    float16 first and the codes chosen for the rounded scale (as llama.cpp quantizes)."""
    x = jnp.asarray(x).astype(jnp.float32)
    *lead, k, n = x.shape
    if k % GROUP:
        raise ValueError(f"8-bit group weights need inputs in whole groups of {GROUP}; got {k}")
    g = x.reshape(*lead, k // GROUP, GROUP, n)
    scale = (jnp.max(jnp.abs(g), axis=-2) / QMAX).astype(jnp.float16)
    s32 = scale.astype(jnp.float32)[..., None, :]
    codes = jnp.round(jnp.where(s32 > 0, g / jnp.where(s32 > 0, s32, 1.0), 0.0))
    codes = jnp.clip(codes, -QMAX, QMAX).astype(jnp.int8).reshape(x.shape)
    return Int8GroupArray(codes, scale)


def matmul_int8_groups(x, w: Int8GroupArray):
    """x: [..., in] @ a kernel [in, out] -> [..., out] in x's dtype, weight-only (the
    reference form, and where no kernel takes it)."""
    return jnp.matmul(x, dequantize_int8_groups(w, x.dtype))


def take_rows(table: Int8GroupArray, ids, dtype):
    """Rows `ids` of a table [V, H] -> [len(ids), H]."""
    rows = Int8GroupArray(table.values[ids], table.scale[ids],
                          None if table.offset is None else table.offset[ids])
    return dequantize_int8_groups(rows, dtype)


def concat_int8_groups(arrays: list[Int8GroupArray]) -> Int8GroupArray:
    """Kernels joined along the output axis (q/k/v, gate/up), all in groups of one size and
    all with offsets or all without."""
    if len({a.group for a in arrays}) > 1:
        raise ValueError("8-bit group kernels join only in groups of one size; got "
                         f"{sorted({a.group for a in arrays})}")
    if len({a.offset is None for a in arrays}) > 1:
        raise ValueError("8-bit group kernels join only all with offsets (mins) or all "
                         "without")
    offset = None if arrays[0].offset is None else \
        jnp.concatenate([a.offset for a in arrays], axis=-1)
    return Int8GroupArray(jnp.concatenate([a.values for a in arrays], axis=-1),
                          jnp.concatenate([a.scale for a in arrays], axis=-1), offset)
