"""Matmul on CPUs for fp8 weights with block scales (DeepSeek-V3's 128 x 128), computed from
the fp8 codes without widening the weights, rows independent of their batch
(cpu/fp8_block_matmul.cc).

Each output sums every block of `block` inputs on its own, in float32, k ascending with one
FMA per k (dense_matmul's order within the block), then adds the blocks in ascending order,
each block's sum times its scale in one FMA: one fixed order whatever the number of rows, so
a row's result does not depend on its batch. Weight-only: the activations stay float32.
`fp8_block_matmul_reference` is that order written out in jnp, bit for bit.

The codes are packed as the dense kernel packs them (`dense_matmul_cpu.pack_panels`); the
scales go float32 [ceil(in / block), out], one per input block and output column (a
checkpoint's output blocks repeated over their columns by `column_scales`: 1/32 of the
codes' bytes at blocks of 128 inputs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi, dense_matmul_cpu
from pallas_kernels.q4_matmul_cpu import fma_chain

CODE_DTYPES = dense_matmul_cpu.CODE_DTYPES  # float8_e4m3fn (and int8, float8_e5m2)


def kernel_available() -> bool:
    return jax.default_backend() == "cpu" and cpu_ffi.available("fp8_block_matmul")


def pack_panels(codes):
    """[K, N] 8-bit codes -> the kernel's panel order (dense_matmul_cpu.pack_panels)."""
    return dense_matmul_cpu.pack_panels(codes)


def column_scales(scale, block_out: int, n: int):
    """scale float[..., KB, ceil(n / block_out)] -> float32[..., KB, n]: each output block's
    scale repeated over its columns (a partial last block cut)."""
    s = jnp.repeat(jnp.asarray(scale, jnp.float32), block_out, axis=-1)
    return s[..., :n]


def check_operands(panels, scale, block: int) -> None:
    """8-bit codes [K, N] and float scales [ceil(K / block), N], or a clear error."""
    k, n = panels.shape[-2:]
    if jnp.dtype(panels.dtype).name not in CODE_DTYPES:
        raise ValueError(f"fp8_block_matmul takes 8-bit codes, not {jnp.dtype(panels.dtype)}")
    if block <= 0 or tuple(scale.shape[-2:]) != (-(-k // block), n):
        raise ValueError(f"codes [{k}, {n}] in blocks of {block} inputs need scales "
                         f"[{-(-k // block)}, {n}]; got {tuple(scale.shape)}")


def fp8_block_matmul(x, panels, scale, block: int):
    """x: float[..., K] @ codes [K, N] (packed) with scale float32[ceil(K / block), N] ->
    [..., N] in x's dtype."""
    check_operands(panels, scale, block)
    return cpu_ffi.matmul("fp8_block_matmul", x, panels.shape[1], panels,
                          jnp.asarray(scale, jnp.float32).reshape(-1), block=np.int64(block))


def fp8_block_matmul_reference(x, codes, scale, block: int):
    """What the kernel computes, in jnp: x float[T, K], codes [K, N] (not packed), scale
    float[ceil(K / block), N] -> float32[T, N]: per block an FMA chain over its k from 0,
    then an FMA chain over the blocks of (block sum, its scale) from 0."""
    x = jnp.asarray(x, jnp.float32)
    w = jnp.asarray(codes).astype(jnp.float32)
    k = w.shape[0]
    partials = jnp.stack([fma_chain(x[:, k0:k0 + block].T[:, :, None],
                                    w[k0:k0 + block][:, None, :])
                          for k0 in range(0, k, block)])  # [KB, T, N]
    return fma_chain(partials, jnp.asarray(scale, jnp.float32)[:, None, :])
