"""QuantArray: int8 or float8_e4m3fn values with float32 scales, and quantize / dequantize.

A QuantArray is a pytree (values, scale), so it passes through jit, nn.scan, orbax and
`jax.tree.map` like any pair of arrays. `values` keeps the logical shape of the tensor it
stands for; `scale` has the same rank with size 1 on the axes one scale covers:

    kernel [in, out], per output channel: values int8[in, out], scale f32[1, out]
    kernel [in, out], per tensor:         values f8[in, out],   scale f32[1, 1]
    layer-stacked kernel [L, in, out]:     scale f32[L, 1, out] or f32[L, 1, 1]
    embedding [V, H], per row:             scale f32[V, 1]

so the real value is always `values * scale` by broadcasting. Flax's `self.param` compares
the first leaf of a stored parameter (`values`) with the declared shape, so a QuantArray can
stand wherever the model declares a plain weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

# scheme name -> storage dtype; the largest magnitude each represents (e4m3fn has no inf:
# anything past 448 would become NaN, so values are clipped first).
DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def storage_dtype(scheme: str):
    if scheme not in DTYPES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(DTYPES)}")
    return jnp.dtype(DTYPES[scheme])


class ValuesShaped:
    """A quantized weight's logical shape: its `values`' (QuantArray, quant/int4.Int4Array)."""
    values: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)


@jax.tree_util.register_dataclass
@dataclass
class QuantArray(ValuesShaped):
    values: jax.Array  # int8 | float8_e4m3fn, the logical shape
    scale: jax.Array  # float32, values' rank, 1 on the axes each scale covers

    @property
    def scheme(self) -> str:
        return "int8" if jnp.dtype(self.values.dtype) == jnp.int8 else "fp8"

    @property
    def per_tensor(self) -> bool:
        """One scale for the last two axes (per layer when layer-stacked)."""
        return self.scale.shape[-2:] == (1, 1)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (self.values, self.scale))

    @property
    def T(self) -> "QuantArray":
        """Transposed (all axes reversed, as ndarray.T): the tied head is `embedding.T`."""
        return QuantArray(self.values.T, self.scale.T)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self, dtype)


def _pow2_ceil(x):
    """The smallest power of two >= x (x > 0): exact in every float dtype."""
    return jnp.exp2(jnp.ceil(jnp.log2(x)))


def scale_for(amax, dtype):
    """float32 scale mapping |x| <= amax onto the storage dtype's range.

    fp8 scales are powers of two: multiplying by them is exact in bf16 / f16 / f32 (so a
    dequantized operand equals values * scale bit for bit), and a float value's relative
    precision does not depend on its binade, so nothing is lost but one subnormal binade.
    int8 scales are amax / 127, so the whole integer range is used.
    """
    dtype = jnp.dtype(dtype)
    amax = jnp.asarray(amax, jnp.float32)
    scale = amax / QMAX[dtype]
    if dtype == jnp.float8_e4m3fn:
        scale = _pow2_ceil(jnp.maximum(scale, jnp.finfo(jnp.float32).tiny))
    return jnp.where(amax > 0, scale, jnp.ones_like(scale))


def cast_scaled(x, scale, dtype):
    """x / scale rounded (to nearest, ties to even) and clipped into the storage dtype."""
    dtype = jnp.dtype(dtype)
    y = jnp.clip(x.astype(jnp.float32) / scale, -QMAX[dtype], QMAX[dtype])
    return (jnp.round(y) if dtype == jnp.int8 else y).astype(dtype)


def quantize(x, dtype, axes: tuple[int, ...]) -> QuantArray:
    """x: float[...] -> QuantArray with one absmax scale per slice over `axes`.

    axes (-2,): per output channel of a [.., in, out] kernel; (-2, -1): per tensor (per layer
    when stacked); (-1,): per row of an embedding table or per (token, head) of K/V.
    """
    x = jnp.asarray(x)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
    scale = scale_for(amax, dtype)
    return QuantArray(cast_scaled(x, scale, dtype), scale)


def dequantize(q: QuantArray, dtype=jnp.float32) -> jax.Array:
    return (q.values.astype(jnp.float32) * q.scale).astype(dtype)
