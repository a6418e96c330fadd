"""A mixture-of-experts layer's stacked expert kernels [E, in, out] laid out for the grouped
CPU kernels (pallas_kernels/grouped_matmul_cpu.py), each expert packed as the single kernel
packs a layer's weight (quant/packed.py):

- float weights, and fp8 or int8 codes with one scale per output channel or per tensor:
  "dense" (weight-only, rows independent of their batch);
- int8 per output channel in the q8 kernel's shapes: "q8", as a dense layer's int8 weight;
- int4 in groups (GGUF's Q4_1 form, quant/int4.py): "q4";
- int8 in groups (GGUF's Q8_0 form, or Q6_K's in groups of 16, with offsets Q5_1, Q5_K and
  Q2_K's, quant/int8_groups.py): "q8_0";
- fp8 with block scales (DeepSeek-V3's form, quant/fp8_blocks.py): "fp8_blocks", the codes
  never widened.

Made once at load (model/runtime_params.py); `quant.ops.grouped_matmul` sends them to their
kernel. Elsewhere (GPUs, a traced tree) the stacked forms stay, through `ragged_dot`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from pallas_kernels import (dense_matmul_cpu, fp8_block_matmul_cpu, grouped_matmul_cpu,
                            q4_matmul_cpu, q8_0_matmul_cpu, q8_matmul_cpu)
from quant.array import QuantArray
from quant.fp8_blocks import Fp8BlockArray
from quant.int4 import Int4Array
from quant.int8_groups import Int8GroupArray


@jax.tree_util.register_dataclass
@dataclass
class PackedExperts:
    operands: tuple  # the kind's packed operands, each with a leading expert axis
    shape: tuple[int, ...] = field(metadata=dict(static=True))  # (E, in, out)
    kind: str = field(metadata=dict(static=True))  # a grouped_matmul_cpu kind
    block: int = field(default=0, metadata=dict(static=True))  # "fp8_blocks": inputs per scale


def _kind(w) -> str | None:
    """The grouped kernel that runs expert kernels `w` [E, in, out], or None."""
    if isinstance(w, Fp8BlockArray):
        return "fp8_blocks"
    if isinstance(w, Int4Array):
        return "q4" if w.shape[-1] % q4_matmul_cpu.PANEL == 0 else None
    if isinstance(w, Int8GroupArray):
        fits = w.group_axis == -2 and q8_0_matmul_cpu.fits(*w.shape[-2:], w.group)
        return "q8_0" if fits else None
    if isinstance(w, QuantArray):
        if w.scale.shape[-2] != 1:
            return None
        if (w.scheme == "int8" and not w.per_tensor and w.shape[-1] % q8_matmul_cpu.PANEL == 0
                and w.shape[-2] % 4 == 0):
            return "q8"
        return "dense"
    dtype = jnp.dtype(w.dtype).name
    return "dense" if dtype in dense_matmul_cpu.WEIGHT_DTYPES else None


def packable(w) -> bool:
    """Concrete expert kernels [E, in, out] with a grouped kernel built for their form."""
    if not (hasattr(w, "shape") and len(w.shape) == 3):
        return False
    leaves = jax.tree.leaves(w)
    if any(isinstance(a, jax.core.Tracer) for a in leaves):
        return False
    kind = _kind(w)
    return kind is not None and grouped_matmul_cpu.kernel_available(kind)


def pack(w) -> PackedExperts:
    kind, shape = _kind(w), tuple(w.shape)
    if kind == "fp8_blocks":
        scale = fp8_block_matmul_cpu.column_scales(w.scale, w.block[1], shape[2])
        return PackedExperts(grouped_matmul_cpu.pack_experts(kind, w.values, scale), shape, kind,
                             w.block[0])
    if kind == "q4":
        operands = (w.values, w.scale, w.zero)
    elif kind == "q8_0":
        operands = (w.values, w.scale) + (() if w.offset is None else (w.offset,))
    elif isinstance(w, QuantArray):  # q8 or dense codes: one scale per expert and channel
        operands = (w.values, jnp.broadcast_to(w.scale.astype(jnp.float32),
                                               (shape[0], 1, shape[2])).reshape(shape[0], -1))
    else:
        operands = (w,)
    return PackedExperts(grouped_matmul_cpu.pack_experts(kind, *operands), shape, kind)


def grouped_matmul(x, w: PackedExperts, group_sizes):
    """x [M, in], rows sorted by expert, group_sizes int32[E] -> [M, out] in x's dtype."""
    return grouped_matmul_cpu.grouped_matmul(w.kind, x, group_sizes, *w.operands,
                                             block=w.block)
