"""The two places a weight meets activations, for plain or quantized weights: matmul and
embedding lookup. Each quantized form is written in the shape XLA:GPU knows how to fuse.

- int8 or fp8, per output channel (weight-only, W8A16): `x @ convert(values)` accumulated in
  float32, then times the channel scales. The widening convert is what XLA's Triton GEMM
  fusion can absorb, and the scale is an epilogue multiply on [T, out], not on the weight.
- packed for our CPU kernels (quant/packed.py): int8 per output channel by q8_matmul; any
  other weight, fp8 included (weight-only, scales after the sum), by dense_matmul.
- int4 in groups (quant/int4.py): packed on CPUs for q4_matmul (activations rounded to
  int16 per group of 32 there); elsewhere dequantized into the dot, weight-only.
- int8 in groups of 32 or 16 (quant/int8_groups.py, GGUF's Q8_0 and Q6_K; with offsets
  Q5_1, Q5_K and Q2_K): packed on CPUs for q8_0_matmul (the same int16 activations per group
  of 32) where the inputs are whole groups of 32; elsewhere dequantized into the dot,
  weight-only.
- fp8 with block scales (quant/fp8_blocks.py, DeepSeek-V3's 128 x 128): packed on CPUs for
  fp8_block_matmul (weight-only, each input block summed alone, then times its scale);
  elsewhere, up to 64 rows, fp8 activations per row and input block against the fp8 codes
  in one batched fp8 dot per input block, more rows dequantized into the dot.
- fp8 per tensor (W8A8): the activations are quantized to fp8 with one dynamic power-of-two
  scale per call, and both sides are written `fp8 -> convert -> multiply by a scalar -> dot`,
  the only pattern XLA rewrites to a cuBLASLt fp8 GEMM (`__cublas$lt$matmul$f8`, sm89+).
  Elsewhere the same numbers come out of an ordinary dot. The activation scale spans every
  token of the call, so a token's result can depend (slightly) on the others in its batch.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul_gpu
from quant import packed, packed_experts
from quant.array import QuantArray, cast_scaled, dequantize, scale_for
from quant.fp8_blocks import Fp8BlockArray, matmul_fp8_blocks
from quant.int4 import Int4Array, is_quantized, matmul_int4
from quant.int8_groups import Int8GroupArray, matmul_int8_groups, take_rows

FP8 = jnp.dtype(jnp.float8_e4m3fn)


def matmul(x, w):
    """x: [..., in] @ w: [in, out] (an array, one of the quantized forms or their CPU packings)
    -> [..., out] in x's dtype."""
    if isinstance(w, packed.PackedQ8):
        return packed.matmul(x, w)
    if isinstance(w, packed.PackedDense):
        return packed.dense_matmul(x, w)
    if isinstance(w, packed.PackedQ4):
        return packed.q4_matmul(x, w)
    if isinstance(w, packed.PackedQ80):
        return packed.q8_0_matmul(x, w)
    if isinstance(w, packed.PackedFp8Blocks):
        return packed.fp8_block_matmul(x, w)
    if isinstance(w, Fp8BlockArray):
        return matmul_fp8_blocks(x, w)
    if isinstance(w, Int4Array):
        return matmul_int4(x, w)
    if isinstance(w, Int8GroupArray):
        return matmul_int8_groups(x, w)
    if not isinstance(w, QuantArray):
        return x @ w.astype(x.dtype)
    if w.scale.shape[-2] != 1 or w.ndim != 2:
        raise ValueError(f"a quantized [in, out] weight needs per-output-channel or per-tensor "
                         f"scales; got values {w.shape}, scale {w.scale.shape}")
    if w.per_tensor and jnp.dtype(w.values.dtype) == FP8:
        return fp8_matmul(x, w)
    y = jnp.matmul(x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w.scale[0]).astype(x.dtype)


def grouped_matmul(x, w, group_sizes, backend: str = "auto"):
    """Rows of x sorted by group, each against its group's weight: x [M, in], w [G, in, out]
    (an array or a quantized form with a leading group axis), group_sizes int32[G] summing
    to at most M -> [M, out] in x's dtype; rows past the groups' sum come out zero. The
    mixture-of-experts matmul (model/moe.py): one group per expert, shapes fixed whatever
    the mix. Packed for the grouped CPU kernels (quant/packed_experts.py), each row gets what
    the single kernel gives it alone. Otherwise quantized weights are dequantized into it
    (weight-only) and `backend` (ModelConfig.moe_backend, --moe-backend) picks the matmul:
    - "auto": our Pallas kernel (pallas_kernels/grouped_matmul_gpu.py) where the program is
      lowered for CUDA and the shape fits its tiles, `jax.lax.ragged_dot` elsewhere. XLA:GPU
      (jaxlib 0.11.2) compiles ragged_dot into a dense dot over every expert, E times the
      work (quant/moe_hlo.py); on CPUs and TPUs nothing changes.
    - "ragged_dot": `jax.lax.ragged_dot` on every platform.
    - "pallas": the Pallas kernel, compiled for CUDA, in the interpreter elsewhere (tests).
    """
    if backend not in ("auto", "ragged_dot", "pallas"):
        raise ValueError(f"unknown MoE backend {backend!r}; choose one of auto, ragged_dot, "
                         f"pallas")
    if isinstance(w, packed_experts.PackedExperts):
        return packed_experts.grouped_matmul(x, w, group_sizes)
    if is_quantized(w):
        w = w.dequantize(x.dtype)
    w = w.astype(x.dtype)
    if backend == "ragged_dot" or (backend == "auto"
                                   and not grouped_matmul_gpu.fits(*w.shape[1:])):
        return _ragged_dot(x, w, group_sizes)
    native = partial(_pallas_grouped_matmul, interpret=False)
    elsewhere = (_ragged_dot if backend == "auto"
                 else partial(_pallas_grouped_matmul, interpret=True))
    return jax.lax.platform_dependent(x, w, group_sizes, cuda=native, default=elsewhere)


def _ragged_dot(x, w, group_sizes):
    y = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _pallas_grouped_matmul(x, w, group_sizes, *, interpret: bool):
    return grouped_matmul_gpu.grouped_matmul(x, w, group_sizes, interpret=interpret)


def matmul_t(x, w):
    """x: [..., in] times w: [out, in] transposed -> [..., out]: the tied head, `w` being the
    embedding table (an array or a QuantArray with one scale per row).

    Written as a dot over w's last axis rather than `matmul(x, w.T)`: XLA:CPU copies a
    transposed operand before its dot, which for SmolLM2's table is 113 MiB on every step."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if isinstance(w, Int8GroupArray):
        return jax.lax.dot_general(x, w.dequantize(x.dtype), dims)
    if not isinstance(w, QuantArray):
        return jax.lax.dot_general(x, w.astype(x.dtype), dims)
    if w.ndim != 2 or w.scale.shape[-1] != 1:
        raise ValueError(f"a quantized [out, in] table needs one scale per row; got values "
                         f"{w.shape}, scale {w.scale.shape}")
    y = jax.lax.dot_general(x, w.values.astype(x.dtype), dims,
                            preferred_element_type=jnp.float32)
    return (y * w.scale[:, 0]).astype(x.dtype)


def quantize_activations(x):
    """x: float[..., in] -> (fp8 values, float32 scalar power-of-two scale)."""
    scale = scale_for(jnp.max(jnp.abs(x)).astype(jnp.float32), FP8)
    return cast_scaled(x, scale, FP8), scale


def fp8_matmul(x, w: QuantArray):
    """W8A8 fp8 with per-tensor scales, in the pattern of XLA's cuBLASLt fp8 GEMM rewrite."""
    xq, xs = quantize_activations(x)
    a = xq.astype(x.dtype) * xs.astype(x.dtype)  # powers of two: exact in x's dtype
    b = w.values.astype(x.dtype) * w.scale.reshape(()).astype(x.dtype)
    return a @ b


def take(table, ids, dtype):
    """Rows `ids` of an embedding table [V, H] (an array, a QuantArray or an
    Int8GroupArray) -> [len(ids), H]."""
    if isinstance(table, Int8GroupArray):
        return take_rows(table, ids, dtype)
    if not isinstance(table, QuantArray):
        return table[ids].astype(dtype)
    scale = table.scale if table.scale.shape[0] == 1 else table.scale[ids]
    return (table.values[ids].astype(jnp.float32) * scale).astype(dtype)


def dequantize_tree(params, dtype=jnp.float32):
    """Every quantized weight (QuantArray, Int4Array, Int8GroupArray, Fp8BlockArray) in a tree
    replaced by its dequantized array."""
    return jax.tree.map(lambda a: a.dequantize(dtype) if is_quantized(a) else a,
                        params, is_leaf=is_quantized)
