"""int8-weight matmul on CPUs: `x @ (values * scale)` by our C++ kernel (cpu/q8_matmul.cc).

The weight is packed once, at load, in panels of 16 output channels (`pack_panels`); the
kernel widens the int8 values in registers, so a decode step reads a quarter of the bytes
of a float32 weight. Each row of x is rounded to int16 with a scale of its own and the
products are summed as integers, 512 values of k at a time; `q8_matmul_reference` is that
same product in plain jnp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi
from pallas_kernels.host_layout import array_module, placed

PANEL = 16  # output channels per panel: what the kernel's tiles are written for
BLOCK = 512  # values of k the kernel sums as int32 before going to float
QMAX = 32767.0  # a row of x is rounded to int16 in [-QMAX, QMAX]


def pack_panels(values):
    """int8[K, N] -> int8[K, N] holding the panels, pairs of k side by side:
    flat[p, k // 2, j, k % 2] = values[k, PANEL * p + j].

    The result keeps the [in, out] shape (Flax checks a weight's shape against its
    declaration); only the order of the bytes differs."""
    K, N = values.shape
    xp = array_module(values)  # numpy for weights on one device (host_layout.py)
    v = xp.asarray(values).reshape(K // 2, 2, N // PANEL, PANEL)
    return placed(v.transpose(2, 0, 3, 1).reshape(K, N), values)


def unpack_panels(panels):
    """The inverse of `pack_panels`."""
    K, N = panels.shape
    return panels.reshape(N // PANEL, K // 2, PANEL, 2).transpose(1, 3, 0, 2).reshape(K, N)


def q8_matmul(x, panels, scale):
    """x: float[..., K] @ weight int8[K, N] (packed) * scale float32[N] -> [..., N] in x's
    dtype."""
    N = panels.shape[1]
    return cpu_ffi.matmul("q8_matmul", x, N, panels, scale.reshape(N).astype(jnp.float32))


def quantize_rows(x):
    """float32[T, K] -> (int16 values [T, K], float32 scales [T, 1]) as the kernel rounds
    them: x ~ scale * values. A row of zeros has scale 0; a row with an inf or a NaN, NaN."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    finite = jnp.all(jnp.isfinite(x), axis=-1, keepdims=True)
    inv = jnp.where(finite & (amax > 0), jnp.float32(QMAX) / amax, 0.0)
    values = jnp.round(jnp.where(finite, x, 0.0) * inv).astype(jnp.int16)
    return values, jnp.where(finite, amax / jnp.float32(QMAX), jnp.nan)


def q8_matmul_reference(x, values, scale):
    """The kernel's product from the unpacked int8[K, N] values, in plain jnp."""
    K, N = values.shape
    x2 = x.reshape(-1, K).astype(jnp.float32)
    xq, xs = quantize_rows(x2)
    step = xs * scale.reshape(1, N).astype(jnp.float32)
    y = None
    for k0 in range(0, K, BLOCK):
        block = jax.lax.dot(xq[:, k0:k0 + BLOCK].astype(jnp.int32),
                            values[k0:k0 + BLOCK].astype(jnp.int32),
                            preferred_element_type=jnp.int32)
        part = block.astype(jnp.float32) * step
        y = part if y is None else y + part
    return y.reshape(*x.shape[:-1], N).astype(x.dtype)
