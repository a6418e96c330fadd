"""Grouped matmul on CPUs, a mixture-of-experts layer's projections: rows of x sorted by
expert, each group of rows against its own expert's weight, by the grouped forms of our C++
matmul kernels (`xlaserve_<kernel>_grouped` in cpu/dense_matmul.cc, q8_matmul.cc,
q4_matmul.cc, q8_0_matmul.cc). XLA's `ragged_dot` runs on CPUs as every row against every
expert, masked; here each row meets its own expert's weight only, and through the single
kernel's code, so it gets the same bits as that kernel gives it alone: batch invariant.

Kinds, each a kernel with its operands stacked on a leading expert axis E:
  "dense": float32 / bfloat16 / float16 weights, or 8-bit codes with a scale per output
           channel (dense_matmul_cpu)
  "q8":    int8 values with a scale per output channel (q8_matmul_cpu)
  "q4":    GGUF's Q4_1 codes with a scale and offset per group of 32 (q4_matmul_cpu)
  "q8_0":  GGUF's Q8_0 int8 codes with a scale per group of 32, or Q6_K's per group of 16
           (q8_0_matmul_cpu), the group size following from the scales' shape; with an
           offset per group too for Q5_1, Q5_K and Q2_K
  "fp8_blocks": fp8 codes with a scale per block of inputs and output column, the block
           size an attribute (fp8_block_matmul_cpu)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (cpu_ffi, dense_matmul_cpu, fp8_block_matmul_cpu, q4_matmul_cpu,
                            q8_0_matmul_cpu, q8_matmul_cpu)
from pallas_kernels.q4_matmul_cpu import fma_chain

KERNELS = {"dense": "dense_matmul", "q8": "q8_matmul", "q4": "q4_matmul",
           "q8_0": "q8_0_matmul", "fp8_blocks": "fp8_block_matmul"}


def _kernel(kind: str) -> str:
    if kind not in KERNELS:
        raise ValueError(f"unknown grouped matmul kind {kind!r}; there are {', '.join(KERNELS)}")
    return KERNELS[kind]


def kernel_available(kind: str) -> bool:
    return jax.default_backend() == "cpu" and cpu_ffi.grouped_available(_kernel(kind))


def _pack_dense(w, scale=None):
    panels = jax.vmap(dense_matmul_cpu.pack_panels)(w)
    if scale is None:
        return (panels,)
    return panels, jnp.asarray(scale, jnp.float32).reshape(w.shape[0], w.shape[2])


def _pack_q8(values, scale):
    E, _, N = values.shape
    panels = jax.vmap(q8_matmul_cpu.pack_panels)(jnp.asarray(values, jnp.int8))
    return panels, jnp.asarray(scale, jnp.float32).reshape(E, N)


def _pack_fp8_blocks(codes, scale):
    return (jax.vmap(fp8_block_matmul_cpu.pack_panels)(codes),
            jnp.asarray(scale, jnp.float32))


_PACK = {"dense": _pack_dense, "q8": _pack_q8,
         "q4": jax.vmap(q4_matmul_cpu.pack_panels),
         "q8_0": jax.vmap(q8_0_matmul_cpu.pack_panels),
         "fp8_blocks": _pack_fp8_blocks}


def pack_experts(kind: str, values, *scales) -> tuple:
    """E stacked expert weights -> the kind's packed operands, each with a leading axis E:
    every expert packed by its kernel's own `pack_panels`.

      dense: w [E, K, N] (float, or 8-bit codes with scale float[E, N])
             -> (panels,) or (panels, scale float32[E, N])
      q8:    values int8[E, K, N], scale float[E, N] -> (panels, scale float32[E, N])
      q4:    codes uint8[E, K, N] (0..15), d, m float[E, K // 32, N] -> (codes, dp, mp)
      q8_0:  codes int8[E, K, N], d (and offsets m) float[E, K // g, N] (g = 32 or 16)
             -> (codes, dp) or (codes, dp, mp)
      fp8_blocks: codes [E, K, N], scale float[E, ceil(K / block), N] (per column)
             -> (panels, scale float32)
    """
    return tuple(_PACK[kind](jnp.asarray(values), *scales))


def grouped_matmul(kind: str, x, group_sizes, *packed, block: int = 0):
    """x: float[M, K], rows sorted by group; group_sizes int32[E], summing to at most M;
    packed: `pack_experts(kind, ...)` -> [M, N] in x's dtype: group e's rows times expert
    e's weight, rows past sum(group_sizes) zeros. block: the inputs per scale of
    "fp8_blocks"."""
    kernel = _kernel(kind)
    if jnp.ndim(x) != 2 or jnp.ndim(group_sizes) != 1:
        raise ValueError("grouped_matmul takes x [M, K] and group_sizes [E]")
    E, _, N = packed[0].shape
    if jnp.shape(group_sizes)[0] != E:
        raise ValueError(f"{E} experts' weights but {jnp.shape(group_sizes)[0]} group sizes")
    operands = list(packed)
    if kind in ("dense", "q8"):  # the scale goes flat; float weights take an empty one
        eight_bit = jnp.dtype(packed[0].dtype).name in dense_matmul_cpu.CODE_DTYPES
        if kind == "dense" and eight_bit != (len(packed) == 2):
            raise ValueError(f"{jnp.dtype(packed[0].dtype).name} weights "
                             + ("need a scale" if eight_bit else "take no scale"))
        scale = packed[1] if len(packed) == 2 else jnp.zeros((0,), jnp.float32)
        operands = [packed[0], scale.astype(jnp.float32).reshape(-1)]
    if kind == "fp8_blocks":
        fp8_block_matmul_cpu.check_operands(packed[0][0], packed[1][0], block)
        return cpu_ffi.grouped_matmul(kernel, x, group_sizes, N, packed[0],
                                      packed[1].reshape(-1), block=np.int64(block))
    if kind == "q8_0":
        group = q8_0_matmul_cpu.weight_group(packed[0].shape[1], packed[1].shape[-2])
        mp = packed[2] if len(packed) == 3 else None
        offsets = q8_0_matmul_cpu.flat_offsets(packed[1], mp)
        return cpu_ffi.grouped_matmul(kernel, x, group_sizes, N, packed[0],
                                      packed[1].reshape(-1), offsets,
                                      group=np.int64(group))
    return cpu_ffi.grouped_matmul(kernel, x, group_sizes, N, *operands)


def _dense_reference(x, w, scale=None):
    """dense_matmul's product in plain jnp: each output an FMA chain over k ascending, then
    times its channel's scale; bfloat16 weights as `bf16_pairs_reference` sums them."""
    if jnp.dtype(jnp.asarray(w).dtype) == jnp.bfloat16:
        return jnp.asarray(dense_matmul_cpu.bf16_pairs_reference(x, w))
    y = fma_chain(x.astype(jnp.float32).T[:, :, None],
                  jnp.asarray(w).astype(jnp.float32)[:, None, :])
    return y if scale is None else y * jnp.asarray(scale, jnp.float32).reshape(1, -1)


_REFERENCE = {"dense": _dense_reference, "q8": q8_matmul_cpu.q8_matmul_reference,
              "q4": q4_matmul_cpu.q4_matmul_reference,
              "q8_0": q8_0_matmul_cpu.q8_0_matmul_reference,
              "fp8_blocks": fp8_block_matmul_cpu.fp8_block_matmul_reference}


def grouped_matmul_reference(kind: str, x, group_sizes, *unpacked, block: int = 0):
    """The kernel's product in plain jnp, from the weights as `pack_experts` takes them
    (`unpacked`, each with a leading axis E) and concrete group sizes: each group's rows
    through its kind's reference against its expert's weight -> [M, N] in x's dtype."""
    extra = (block,) if kind == "fp8_blocks" else ()
    _kernel(kind)
    sizes = np.asarray(group_sizes, np.int64)
    M, N = jnp.shape(x)[0], jnp.shape(unpacked[0])[2]
    if (sizes < 0).any() or sizes.sum() > M:
        raise ValueError(f"group sizes {sizes.tolist()} do not fit {M} rows")
    y = jnp.zeros((M, N), jnp.float32)
    start = 0
    for e, rows in enumerate(sizes):
        if rows:
            part = _REFERENCE[kind](jnp.asarray(x[start:start + rows], jnp.float32),
                                    *(u[e] for u in unpacked), *extra)
            y = y.at[start:start + rows].set(part)
        start += rows
    return y.astype(jnp.asarray(x).dtype)
