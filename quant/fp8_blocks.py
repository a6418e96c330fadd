"""Fp8BlockArray: float8_e4m3fn weights with one float32 scale per block of inputs x outputs,
DeepSeek-V3's form (`quant_method: fp8` with `weight_block_size`, 128 x 128 there), kept in
fp8 on the device: a 671 GB fp8 checkpoint widened to bfloat16 would not fit.

For a kernel [in, out] with blocks of bi inputs x bo outputs:

    W[i, o] = float32(values[i, o]) * scale[i // bi, o // bo]
    scale: float32 [ceil(in / bi), ceil(out / bo)]

rounded once to the dtype asked for. The last block of an axis may be partial (an axis that
is no multiple of its block), as the checkpoints store it. Stacked layers and experts add
leading axes to both arrays ([L, E, in, out] values, [L, E, in / bi, out / bo] scales). The
block is static (part of the tree's structure): a scale's shape alone does not give it back.

Checkpoints store [out, in] with `weight_block_size` [bo, bi]; ours is [in, out] like every
kernel here. A kernel whose output blocks are cut (joined q/k/v whose parts are no multiple
of bo) has its scales repeated per output column, block (bi, 1): the same numbers.

The matmul off the CPU kernels (quant/packed.py runs them on CPUs) is written for XLA:GPU:
- up to bi / 2 rows (64) and inputs in whole blocks: the activations are quantized to fp8
  per row and block of bi inputs (scale amax / 448, as DeepSeek-V3's inference and vLLM's
  block fp8 do), then one dot batched over the input blocks with both operands fp8 (XLA:GPU
  emits a Triton GEMM of fp8 operands, or for a single row a reduction reading the fp8
  weights once), each block's float32 product times its activation and weight scales, the
  blocks summed. The weights are read once, in 8 bits;
- more rows: the weights dequantized into the dot (weight-only). The partial products above
  are [in / bi, rows, out] float32, written and read again: 8 * rows * out * in / bi bytes,
  more than one bfloat16 copy of the weights (4 * in * out, written and read) past bi / 2
  rows.
On CPUs without our kernels (a tree prepared inside a program) it is the dequantized form
(`lax.platform_dependent`): the format's own weights, activations unrounded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.host_layout import array_module, placed
from quant.array import ValuesShaped

BLOCK = (128, 128)  # (inputs, outputs) per scale: DeepSeek-V3's [128, 128]
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0


@jax.tree_util.register_dataclass
@dataclass
class Fp8BlockArray(ValuesShaped):
    values: jax.Array  # float8_e4m3fn [..., in, out]
    scale: jax.Array  # float32 [..., ceil(in / bi), ceil(out / bo)]
    block: tuple[int, int] = field(default=BLOCK, metadata=dict(static=True))  # (bi, bo)

    @property
    def scheme(self) -> str:
        return "fp8"

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (self.values, self.scale))

    def describe(self) -> str:
        """The form's name in logs, its block as outputs x inputs (a checkpoint's
        `weight_block_size` order): 'fp8 with 128x128 block scales'."""
        bi, bo = self.block
        if bo == 1:
            return f"fp8 with {bi}-input block scales per column"
        return f"fp8 with {bo}x{bi} block scales"

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_fp8_blocks(self, dtype)


def num_blocks(size: int, block: int) -> int:
    return -(-size // block)


def expand(scale, block: int, size: int, axis: int):
    """A block scale repeated over its block along `axis`, cut to `size` (a partial last
    block)."""
    xp = np if isinstance(scale, np.ndarray) else jnp
    return xp.take(xp.repeat(scale, block, axis=axis), xp.arange(size), axis=axis)


def column_scales(w: Fp8BlockArray):
    """float32 [..., in / bi, out]: each input block's scale per output column."""
    return expand(jnp.asarray(w.scale, jnp.float32), w.block[1], w.shape[-1], -1)


def dequantize_fp8_blocks(w: Fp8BlockArray, dtype=jnp.float32) -> jax.Array:
    """values (exact in float32) times their block's scale in float32, rounded once to
    dtype: the checkpoint format's own dequantization."""
    k, n = w.shape[-2:]
    s = expand(expand(jnp.asarray(w.scale, jnp.float32), w.block[1], n, -1), w.block[0], k, -2)
    return (jnp.asarray(w.values).astype(jnp.float32) * s).astype(dtype)


def quantize_fp8_blocks(x, block: tuple[int, int] = BLOCK) -> Fp8BlockArray:
    """float[..., in, out] -> Fp8BlockArray: per block scale = amax / 448 (a block of zeros
    gets 1), values = x / scale rounded to nearest, DeepSeek-V3's own weight quantization."""
    x = jnp.asarray(x).astype(jnp.float32)
    *lead, k, n = x.shape
    bi, bo = block
    kb, nb = num_blocks(k, bi), num_blocks(n, bo)
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, kb * bi - k), (0, nb * bo - n)])
    blocks = padded.reshape(*lead, kb, bi, nb, bo)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    full = expand(expand(scale, bo, n, -1), bi, k, -2)
    values = jnp.clip(x / full, -FP8_MAX, FP8_MAX).astype(FP8)
    return Fp8BlockArray(values, scale, (bi, bo))


def concat_fp8_blocks(arrays: list[Fp8BlockArray]) -> Fp8BlockArray:
    """Kernels joined along the output axis (q/k/v, gate/up), all with one input block. The
    output blocks stay whole where every part but the last fills its blocks; else the scales
    are repeated per column (block (bi, 1)), the same numbers either way."""
    bi = arrays[0].block[0]
    if any(a.block[0] != bi for a in arrays):
        raise ValueError(f"fp8 block weights of blocks {[a.block for a in arrays]} cannot be "
                         "joined")
    bo = arrays[0].block[1]
    xp = array_module(*(x for a in arrays for x in (a.values, a.scale)))  # numpy on one device
    scales = [xp.asarray(a.scale, np.float32) for a in arrays]
    if not (all(a.block[1] == bo for a in arrays)
            and all(a.shape[-1] % bo == 0 for a in arrays[:-1])):
        scales = [expand(s, a.block[1], a.shape[-1], -1) for s, a in zip(scales, arrays)]
        bo = 1
    values = xp.concatenate([xp.asarray(a.values) for a in arrays], axis=-1)
    return Fp8BlockArray(placed(values, arrays[0].values),
                         placed(xp.concatenate(scales, axis=-1), arrays[0].scale), (bi, bo))


def quantize_activations(x, bi: int):
    """x: float[M, K], K a multiple of bi -> (fp8 [M, K / bi, bi], float32 scales
    [M, K / bi, 1]): one scale per row and block of inputs, amax / 448."""
    m, k = x.shape
    xb = x.astype(jnp.float32).reshape(m, k // bi, bi)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(xb / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def fp8_block_dot(x, w: Fp8BlockArray):
    """x: float[M, K] (K in whole input blocks) @ w -> [M, N] in x's dtype, both operands
    fp8: per input block b, (xq_b @ values_b) in float32 times xs[:, b] and the block's
    weight scales, the blocks summed."""
    m, k = x.shape
    bi, n = w.block[0], w.shape[-1]
    xq, xs = quantize_activations(x, bi)
    y = jax.lax.dot_general(xq, jnp.asarray(w.values).reshape(k // bi, bi, n),
                            (((2,), (1,)), ((1,), (0,))),
                            preferred_element_type=jnp.float32)  # [K / bi, M, N]
    y = y * xs.transpose(1, 0, 2) * column_scales(w)[:, None, :]
    return jnp.sum(y, axis=0).astype(x.dtype)


def _dequantized_dot(x, w: Fp8BlockArray):
    return jnp.matmul(x, dequantize_fp8_blocks(w, x.dtype))


def matmul_fp8_blocks(x, w: Fp8BlockArray):
    """x: [..., in] @ w [in, out] -> [..., out] in x's dtype, as the module docstring says."""
    if w.ndim != 2:
        raise ValueError(f"an fp8 block matmul takes a kernel [in, out]; got {w.shape}")
    *lead, k = x.shape
    rows = int(np.prod(lead))
    if rows > w.block[0] // 2 or k % w.block[0]:
        return _dequantized_dot(x, w)
    flat = x.reshape(rows, k)
    y = jax.lax.platform_dependent(flat, w, cpu=_dequantized_dot, default=fp8_block_dot)
    return y.reshape(*lead, w.shape[-1])
