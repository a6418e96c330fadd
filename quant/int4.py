"""Int4Array: 4-bit weights in groups of 32 along the input axis, GGUF's Q4_1 form.

For k in group g = k // 32 of a kernel [in, out]:

    W[k, n] = scale[g, n] * values[k, n] + zero[g, n],   values in 0..15

with scale and zero float16, as Q4_1 stores them: `quantize_int4` of a Q4_1 checkpoint's
dequantized weights (the demo model's) gives back its codes, scales and offsets, so the
weights served are the file's own. Stacked layers add a leading axis to all three.

values is a uint8 array of the kernel's shape, a code a byte (checkpoints store no uint4;
the CPU kernel's packed form, quant/packed.PackedQ4, holds two a byte). Flax compares a
stored parameter's first leaf with the declared shape, and values is that leaf.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.host_layout import array_module, placed
from pallas_kernels.q4_matmul_cpu import GROUP  # values of the input axis per scale and zero
from quant.array import QuantArray, ValuesShaped
from quant.fp8_blocks import Fp8BlockArray
from quant.int8_groups import Int8GroupArray

LEVELS = 15  # codes 0..15


@jax.tree_util.register_dataclass
@dataclass
class Int4Array(ValuesShaped):
    values: jax.Array  # uint8 [..., in, out], codes 0..15
    scale: jax.Array  # float16 [..., in // 32, out]
    zero: jax.Array  # float16 [..., in // 32, out]

    @property
    def scheme(self) -> str:
        return "int4"

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_int4(self, dtype)


# every quantized weight form: leaves of a tree walk
QUANTIZED = (QuantArray, Int4Array, Int8GroupArray, Fp8BlockArray)


def is_quantized(a) -> bool:
    return isinstance(a, QUANTIZED)


def check_shape(shape: tuple[int, ...]) -> None:
    if len(shape) < 2 or shape[-2] % GROUP != 0:
        raise ValueError(f"int4 weights come in groups of {GROUP} along the input axis; a "
                         f"weight of shape {tuple(shape)} has {shape[-2] if shape else 0} "
                         "inputs")


def quantize_int4(x) -> Int4Array:
    """float[..., in, out] -> Int4Array, each group's range [min, max] over 16 levels.

    The scale and zero are rounded to float16 first and the codes chosen for the rounded
    values, so a weight that already is d * code + m for float16 d and m comes back exact."""
    x = jnp.asarray(x).astype(jnp.float32)
    check_shape(x.shape)
    *lead, k, n = x.shape
    g = x.reshape(*lead, k // GROUP, GROUP, n)
    lo, hi = jnp.min(g, axis=-2), jnp.max(g, axis=-2)
    zero = lo.astype(jnp.float16)
    scale = ((hi - lo) / LEVELS).astype(jnp.float16)
    s32, z32 = scale.astype(jnp.float32)[..., None, :], zero.astype(jnp.float32)[..., None, :]
    codes = jnp.round(jnp.where(s32 > 0, (g - z32) / jnp.where(s32 > 0, s32, 1.0), 0.0))
    codes = jnp.clip(codes, 0, LEVELS).astype(jnp.uint8).reshape(x.shape)
    return Int4Array(codes, scale, zero)


def dequantize_int4(q: Int4Array, dtype=jnp.float32) -> jax.Array:
    *lead, k, n = q.shape
    codes = q.values.astype(jnp.float32).reshape(*lead, k // GROUP, GROUP, n)
    w = (codes * q.scale.astype(jnp.float32)[..., None, :]
         + q.zero.astype(jnp.float32)[..., None, :])
    return w.reshape(q.shape).astype(dtype)


def matmul_int4(x, w: Int4Array):
    """x: [..., in] @ w -> [..., out] in x's dtype, weight-only (the reference form, and
    where no kernel takes it)."""
    return jnp.matmul(x, dequantize_int4(w, x.dtype))


def concat_int4(arrays: list[Int4Array]) -> Int4Array:
    """Joined along the output axis (q/k/v, gate/up)."""
    fields = [[getattr(a, f) for a in arrays] for f in ("values", "scale", "zero")]
    xp = array_module(*(x for parts in fields for x in parts))  # numpy on one device
    return Int4Array(*(placed(xp.concatenate([xp.asarray(x) for x in parts], axis=-1), parts[0])
                       for parts in fields))
