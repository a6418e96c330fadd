"""Matmul on CPUs whose rows are independent of their batch: `x @ w` by our C++ kernel
(cpu/dense_matmul.cc), each output summed over k in ascending order with one FMA per k,
whatever the number of rows. XLA:CPU's own dot changes its blocking with the row count, so
the same row came out different in its last bits alone and in a batch.

The weight (float32, bfloat16 or float16; or 8-bit codes, int8 / float8_e4m3fn /
float8_e5m2, with one float32 scale per output channel applied after the sum) is packed
once, at load, in panels of 16 output channels (`pack_panels`); rows are computed in
float32 and the result comes back in x's dtype. bfloat16 weights take the rows rounded to
bfloat16 and sum their products two k at a time, in the order of AVX512-BF16's `vdpbf16ps`
(which runs them where the CPU has it): `bf16_pairs_reference` gives the same bits.

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


def _pairs(block):
    """[K, P, W] -> [P, K * W], each panel's k in pairs ([i][j][t] = block[2i + t, :, j]),
    an odd K's last k alone after them (cpu/dense_bf16_pairs.h)."""
    K, P, W = block.shape
    pairs = block[:K // 2 * 2].reshape(K // 2, 2, P, W).transpose(2, 0, 3, 1)
    tail = block[K // 2 * 2:].transpose(1, 0, 2)
    return jnp.concatenate([pairs.reshape(P, K // 2 * 2 * W), tail.reshape(P, K % 2 * W)], axis=1)


def _unpairs(flat, K, P, W):
    """The inverse of `_pairs`: [P, K * W] -> [K, P, W]."""
    pairs = flat[:, :K // 2 * 2 * W].reshape(P, K // 2, W, 2).transpose(1, 3, 0, 2)
    tail = flat[:, K // 2 * 2 * W:].reshape(P, K % 2, W).transpose(1, 0, 2)
    return jnp.concatenate([pairs.reshape(K // 2 * 2, P, W), tail])


def pack_panels(w):
    """[K, N] -> [K, N] holding the panels: flat[p, k, j] = w[k, PANEL * p + j], the last
    panel N % PANEL wide when PANEL does not divide N; bfloat16 panels hold their k in pairs
    (`_pairs`). The shape stays [in, out] (Flax checks a weight's shape against its
    declaration); only the order of the values differs."""
    w = jnp.asarray(w)
    K, N = w.shape
    full = N // PANEL * PANEL
    if jnp.dtype(w.dtype) == jnp.bfloat16:
        body = _pairs(w[:, :full].reshape(K, N // PANEL, PANEL)).reshape(-1)
        narrow = _pairs(w[:, full:].reshape(K, 1, N - full)).reshape(-1)
    else:
        body = w[:, :full].reshape(K, N // PANEL, PANEL).transpose(1, 0, 2).reshape(-1)
        narrow = w[:, full:].reshape(-1)
    return jnp.concatenate([body, narrow]).reshape(K, N)


def unpack_panels(panels):
    """The inverse of `pack_panels`."""
    K, N = panels.shape
    full = N // PANEL * PANEL
    flat = panels.reshape(-1)
    if jnp.dtype(panels.dtype) == jnp.bfloat16:
        body = _unpairs(flat[:K * full].reshape(N // PANEL, K * PANEL), K, N // PANEL, PANEL)
        narrow = _unpairs(flat[K * full:].reshape(1, K * (N - full)), K, 1, N - full)
        return jnp.concatenate([body.reshape(K, full), narrow.reshape(K, N - full)], axis=1)
    body = flat[:K * full].reshape(N // PANEL, K, PANEL).transpose(1, 0, 2).reshape(K, full)
    return jnp.concatenate([body, flat[K * full:].reshape(K, N - full)], axis=1)


def bf16_pairs_reference(x, w):
    """What the kernel computes for bfloat16 weights, in numpy: x float[T, K] rounded to
    bfloat16, w bfloat16 [K, N] (not packed) -> float32[T, N], each output summed
    (acc + x[2i + 1] w[2i + 1]) + x[2i] w[2i] for i ascending, then the odd K's last
    product (every product exact in float32, every sum rounded to nearest even)."""
    x = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    w = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    K = w.shape[0]
    for i in range(K // 2):
        acc = acc + x[:, 2 * i + 1, None] * w[2 * i + 1]
        acc = acc + x[:, 2 * i, None] * w[2 * i]
    if K % 2:
        acc = acc + x[:, K - 1, None] * w[K - 1]
    return acc


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
