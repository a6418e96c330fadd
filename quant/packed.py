"""Weights laid out for the CPU kernels: PackedQ8, an int8 weight for
pallas_kernels/q8_matmul_cpu.py (from a QuantArray with one scale per output channel), and
PackedDense, for pallas_kernels/dense_matmul_cpu.py (rows independent of their batch): a
float32 / bfloat16 / float16 weight, or the 8-bit codes and scales of any other QuantArray
(fp8; int8 in shapes the q8 kernel does not take), computed weight-only.

PackedQ4, an int4 weight (quant/int4.py) for pallas_kernels/q4_matmul_cpu.py, PackedQ80,
an 8-bit group weight (quant/int8_groups.py: GGUF's Q8_0 in groups of 32, its Q6_K in groups
of 16, with offsets Q5_1, Q5_K and Q2_K) for pallas_kernels/q8_0_matmul_cpu.py,
and PackedFp8Blocks, fp8 codes with block scales (quant/fp8_blocks.py, DeepSeek-V3's) for
pallas_kernels/fp8_block_matmul_cpu.py.

Made once at load; `quant.ops.matmul` sends them to their kernels. Checkpoints never hold
them: they are run-time forms, like the joined projections of model/runtime_params.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from pallas_kernels import (cpu_ffi, dense_matmul_cpu, fp8_block_matmul_cpu, q4_matmul_cpu,
                            q8_0_matmul_cpu)
from pallas_kernels.host_layout import array_module, placed
from pallas_kernels.q8_matmul_cpu import PANEL, pack_panels, q8_matmul
from quant.array import QuantArray
from quant.fp8_blocks import Fp8BlockArray
from quant.int4 import Int4Array
from quant.int8_groups import Int8GroupArray


@jax.tree_util.register_dataclass
@dataclass
class PackedQ8:
    panels: jax.Array  # int8[in, out], bytes in panel order (see pack_panels)
    scale: jax.Array  # float32[1, out]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.panels.shape)


def kernels_available() -> bool:
    """Whether weights should be packed: a CPU backend with the kernel built."""
    return jax.default_backend() == "cpu" and cpu_ffi.available("q8_matmul")


def packable(w) -> bool:
    """An int8 [in, out] QuantArray, per output channel, in whole panels."""
    return (isinstance(w, QuantArray) and w.ndim == 2 and w.scheme == "int8"
            and tuple(w.scale.shape) == (1, w.shape[1])
            and w.shape[1] % PANEL == 0 and w.shape[0] % 4 == 0)


def pack(w: QuantArray) -> PackedQ8:
    return PackedQ8(pack_panels(w.values), w.scale.reshape(1, -1).astype(jnp.float32))


def pack_head(table: QuantArray) -> PackedQ8 | None:
    """The tied head from an int8 embedding table [vocab, hidden] with per-row scales, or
    None when the table is not in that form."""
    if not (isinstance(table, QuantArray) and table.scheme == "int8"
            and table.ndim == 2 and table.scale.shape[-1] == 1):
        return None
    xp = array_module(table.values, table.scale)  # numpy on one device (host_layout.py)
    head = QuantArray(*(placed(xp.asarray(a).T, a) for a in (table.values, table.scale)))
    return pack(head) if packable(head) else None  # [hidden, vocab], per output channel


def matmul(x, w: PackedQ8):
    """x: [..., in] @ w -> [..., out] in x's dtype."""
    return q8_matmul(x, w.panels, w.scale)


@jax.tree_util.register_dataclass
@dataclass
class PackedDense:
    panels: jax.Array  # float or 8-bit [in, out], values in panel order (see dense_matmul_cpu)
    scale: jax.Array | None = None  # float32[out] for 8-bit codes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.panels.shape)

    @property
    def dtype(self):
        return self.panels.dtype


def dense_kernel_available() -> bool:
    return jax.default_backend() == "cpu" and cpu_ffi.available("dense_matmul")


def dense_packable(w) -> bool:
    """A plain float [in, out] weight, concrete: a tree prepared inside a program (traced,
    perhaps for another platform) keeps XLA's dot."""
    return (isinstance(w, jax.Array) and not isinstance(w, jax.core.Tracer) and w.ndim == 2
            and jnp.dtype(w.dtype).name in dense_matmul_cpu.WEIGHT_DTYPES)


def pack_dense(w) -> PackedDense:
    return PackedDense(dense_matmul_cpu.pack_panels(w))


def codes_packable(w) -> bool:
    """A concrete [in, out] QuantArray with one scale per output channel or per tensor."""
    return (isinstance(w, QuantArray) and w.ndim == 2 and dense_packable(w.scale)
            and not isinstance(w.values, jax.core.Tracer) and w.scale.shape[0] == 1)


def pack_codes(w: QuantArray) -> PackedDense:
    scale = jnp.broadcast_to(w.scale.astype(jnp.float32), (1, w.shape[1])).reshape(-1)
    return PackedDense(dense_matmul_cpu.pack_panels(w.values), scale)


def pack_dense_head(table) -> PackedDense | None:
    """The tied head [hidden, vocab] from an embedding table [vocab, hidden] (float, or
    quantized with one scale per row), or None."""
    if isinstance(table, QuantArray):
        return pack_codes(table.T) if codes_packable(table.T) else None
    if not (dense_packable(table) and dense_packable(table.T)):
        return None
    return pack_dense(table.T)


def dense_matmul(x, w: PackedDense):
    """x: [..., in] @ w -> [..., out] in x's dtype."""
    return dense_matmul_cpu.dense_matmul(x, w.panels, w.scale)


@jax.tree_util.register_dataclass
@dataclass
class PackedQ4:
    codes: jax.Array  # uint4[in, out], in the kernel's byte order (see q4_matmul_cpu)
    scale: jax.Array  # float16[out // 16, in // 32, 16]
    zero: jax.Array  # float16[out // 16, in // 32, 16]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)


def int4_packable(w) -> bool:
    """A concrete [in, out] Int4Array in whole panels, with the kernel built."""
    return (isinstance(w, Int4Array) and w.ndim == 2
            and not isinstance(w.values, jax.core.Tracer)
            and w.shape[1] % q4_matmul_cpu.PANEL == 0
            and jax.default_backend() == "cpu" and cpu_ffi.available("q4_matmul"))


def pack_int4(w: Int4Array) -> PackedQ4:
    return PackedQ4(*q4_matmul_cpu.pack_panels(w.values, w.scale, w.zero))


def q4_matmul(x, w: PackedQ4):
    """x: [..., in] @ w -> [..., out] in x's dtype."""
    return q4_matmul_cpu.q4_matmul(x, w.codes, w.scale, w.zero)


@jax.tree_util.register_dataclass
@dataclass
class PackedQ80:
    codes: jax.Array  # int8[in, out], in the kernel's byte order (see q8_0_matmul_cpu)
    scale: jax.Array  # float16 | float32 [out // 16, in // g, 16], g = 32 or 16
    offset: jax.Array | None = None  # as scale, or None: W = scale * code + offset

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)


def int8_groups_packable(w) -> bool:
    """A concrete kernel [in, out] Int8GroupArray in whole panels, in groups the kernel
    takes and its inputs in whole groups of 32 (the activations'), with the kernel built."""
    if not (isinstance(w, Int8GroupArray) and w.ndim == 2 and w.group_axis == -2
            and not isinstance(w.values, jax.core.Tracer)):
        return False
    return (q8_0_matmul_cpu.fits(*w.shape, w.group)
            and jax.default_backend() == "cpu" and cpu_ffi.available("q8_0_matmul"))


def pack_int8_groups(w: Int8GroupArray) -> PackedQ80:
    return PackedQ80(*q8_0_matmul_cpu.pack_panels(w.values, w.scale, w.offset))


def pack_int8_groups_head(table) -> PackedQ80 | None:
    """The tied head [hidden, vocab] from an Int8GroupArray table [vocab, hidden], or None."""
    if not (isinstance(table, Int8GroupArray) and table.ndim == 2 and table.group_axis == -1):
        return None
    head = table.T
    return pack_int8_groups(head) if int8_groups_packable(head) else None


def q8_0_matmul(x, w: PackedQ80):
    """x: [..., in] @ w -> [..., out] in x's dtype."""
    return q8_0_matmul_cpu.q8_0_matmul(x, w.codes, w.scale, w.offset)


@jax.tree_util.register_dataclass
@dataclass
class PackedFp8Blocks:
    panels: jax.Array  # 8-bit codes [in, out] in panel order (fp8_block_matmul_cpu.pack_panels)
    scale: jax.Array  # float32 [ceil(in / block), out]: per input block and output column
    block: int = field(metadata=dict(static=True))  # inputs per scale

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.panels.shape)

    @property
    def dtype(self):
        return self.panels.dtype


def fp8_blocks_packable(w) -> bool:
    """A concrete kernel [in, out] Fp8BlockArray, with the kernel built."""
    return (isinstance(w, Fp8BlockArray) and w.ndim == 2
            and not isinstance(w.values, jax.core.Tracer)
            and fp8_block_matmul_cpu.kernel_available())


def pack_fp8_blocks(w: Fp8BlockArray) -> PackedFp8Blocks:
    bi, bo = w.block
    return PackedFp8Blocks(fp8_block_matmul_cpu.pack_panels(w.values),
                           fp8_block_matmul_cpu.column_scales(w.scale, bo, w.shape[1]), bi)


def fp8_block_matmul(x, w: PackedFp8Blocks):
    """x: [..., in] @ w -> [..., out] in x's dtype."""
    return fp8_block_matmul_cpu.fp8_block_matmul(x, w.panels, w.scale, w.block)
