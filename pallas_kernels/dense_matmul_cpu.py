"""Matmul on CPUs whose rows are independent of their batch: `x @ w` by our C++ kernel
(cpu/dense_matmul.cc), each output summed over k in ascending order with one FMA per k,
whatever the number of rows. XLA:CPU's own dot changes its blocking with the row count, so
the same row came out different in its last bits alone and in a batch.

The weight (float32, bfloat16 or float16; or 8-bit codes, int8 / float8_e4m3fn /
float8_e5m2, with one float32 scale per output channel applied after the sum) is packed
once, at load, in panels of 16 output channels (`pack_panels`); rows are computed in
float32 and the result comes back in x's dtype.

`dense_argmax` is the greedy head (cpu/dense_argmax.cc): each row's argmax over the product,
the token `argmax_rows(dense_matmul(x, w))` gives, without writing the logits.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi

PANEL = 16  # output channels per panel
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
CODE_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")  # with a scale per output channel


def kernel_available() -> bool:
    return jax.default_backend() == "cpu" and cpu_ffi.available("dense_matmul")


def argmax_available() -> bool:
    return jax.default_backend() == "cpu" and cpu_ffi.available("dense_argmax")


def pack_panels(w):
    """[K, N] -> [K, N] holding the panels: flat[p, k, j] = w[k, PANEL * p + j], the last
    panel N % PANEL wide when PANEL does not divide N. The shape stays [in, out] (Flax checks
    a weight's shape against its declaration); only the order of the values differs."""
    w = jnp.asarray(w)
    K, N = w.shape
    full = N // PANEL * PANEL
    body = w[:, :full].reshape(K, N // PANEL, PANEL).transpose(1, 0, 2).reshape(-1)
    return jnp.concatenate([body, w[:, full:].reshape(-1)]).reshape(K, N)


def unpack_panels(panels):
    """The inverse of `pack_panels`."""
    K, N = panels.shape
    full = N // PANEL * PANEL
    flat = panels.reshape(-1)
    body = flat[:K * full].reshape(N // PANEL, K, PANEL).transpose(1, 0, 2).reshape(K, full)
    return jnp.concatenate([body, flat[K * full:].reshape(K, N - full)], axis=1)


def dense_matmul(x, panels, scale=None):
    """x: float[..., K] @ w [K, N] (packed) -> [..., N] in x's dtype; 8-bit codes need
    scale, float32[N]: the result is (x @ codes) * scale."""
    n = panels.shape[1]
    eight_bit = jnp.dtype(panels.dtype).name in CODE_DTYPES
    if eight_bit != (scale is not None):
        raise ValueError(f"{jnp.dtype(panels.dtype).name} weights "
                         + ("need a scale per output channel" if eight_bit else "take no scale"))
    scale = jnp.zeros((0,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    return cpu_ffi.matmul("dense_matmul", x, n, panels, scale.reshape(-1))


def dense_argmax(x, panels, scale=None, columns: int | None = None):
    """x: float32[T, K] against w [K, N] (packed as for dense_matmul) -> int32[T], each row's
    index of its largest output among the first `columns` (default N): the first index of
    the maximum, a NaN counting as the maximum, as jnp.argmax."""
    if not argmax_available():
        raise RuntimeError("the CPU kernels are not available (no C++ compiler or no AVX2)")
    n = panels.shape[1]
    columns = n if columns is None else columns
    if not 1 <= columns <= n:
        raise ValueError(f"columns must be in [1, {n}], got {columns}")
    if x.ndim != 2 or jnp.dtype(x.dtype) != jnp.float32:
        raise ValueError(f"dense_argmax takes float32 rows [T, K], got {x.dtype}{x.shape}")
    eight_bit = jnp.dtype(panels.dtype).name in CODE_DTYPES
    if eight_bit != (scale is not None):
        raise ValueError(f"{jnp.dtype(panels.dtype).name} weights "
                         + ("need a scale per output channel" if eight_bit else "take no scale"))
    scale = jnp.zeros((0,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    call = jax.ffi.ffi_call("xlaserve_dense_argmax",
                            jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, panels, scale.reshape(-1), columns=np.int64(columns))
