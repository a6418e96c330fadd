"""Grouped matmul as one Pallas kernel (Triton lowering): a mixture of experts' projection on
NVIDIA GPUs, what `quant.ops.grouped_matmul` runs there by default, since XLA:GPU (jaxlib
0.11.2) rewrites `jax.lax.ragged_dot` into a dense dot over every expert (quant/moe_hlo.py;
docs/benchmarks.md, "Mixtures of experts"; scripts/gpu_check.sh times both).

Rows of x come sorted by expert (model/moe.py). The row axis is cut into tiles of `block_m`
rows on a fixed grid; a tile that straddles groups is visited once per group, each visit
computing and storing only its group's rows. The visits are data (`tile_visits`), their
number static: at most cdiv(M, block_m) + E, the rest empty. Program (v, n) takes visit v
and output columns [n * block_n, (n + 1) * block_n): it sums x's rows times its expert's
weight over K in steps of `block_k`, in float32, and stores its rows. Rows no visit covers
(past the groups) keep the zeros the output starts as. The work is the groups' rows, not
every row against every expert.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def block_dividing(dim: int, largest: int) -> int | None:
    """The largest power of two from 16 (Triton's smallest dot) up to `largest` that divides
    `dim`; None if none does (a tensor-parallel shard of an expert can be 96 wide)."""
    block = largest
    while block >= 16:
        if dim % block == 0:
            return block
        block //= 2
    return None


def fits(K: int, N: int, block_k: int = 64, block_n: int = 64) -> bool:
    """Whether grouped_matmul takes a weight of [E, K, N]."""
    return block_dividing(K, block_k) is not None and block_dividing(N, block_n) is not None


def tile_visits(group_sizes, num_rows: int, block_m: int):
    """group_sizes int32[E] -> int32[4, V], V = cdiv(num_rows, block_m) + E: per visit its
    expert, its tile and its group's rows [lo, hi); empty visits have lo == hi == 0."""
    E = group_sizes.shape[0]
    V = -(-num_rows // block_m) + E
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // block_m
    count = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 0)
    before = jnp.cumsum(count) - count
    v = jnp.arange(V, dtype=jnp.int32)
    expert = jnp.clip(jnp.searchsorted(jnp.cumsum(count), v, side="right"), 0, E - 1)
    valid = v < jnp.sum(count)
    tile = jnp.where(valid, first[expert] + v - before[expert], 0)
    lo = jnp.where(valid, starts[expert], 0)
    hi = jnp.where(valid, ends[expert], 0)
    return jnp.stack([jnp.where(valid, expert, 0), tile, lo, hi]).astype(jnp.int32)


def _program(meta_ref, x_ref, w_ref, zeros_ref, o_ref, *, block_m: int, block_n: int,
             block_k: int, K: int):
    del zeros_ref  # the output's initial zeros (aliased)
    v, n = pl.program_id(0), pl.program_id(1)
    expert, tile, lo, hi = (meta_ref[i, v] for i in range(4))
    rows = tile * block_m + jnp.arange(block_m, dtype=jnp.int32)
    mine = ((rows >= lo) & (rows < hi))[:, None]
    cols = (n * block_n + jnp.arange(block_n, dtype=jnp.int32))[None, :]

    def step(i, acc):
        k = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        x = pltriton.load(x_ref.at[rows[:, None], k[None, :]], mask=mine,
                          other=jnp.zeros((), x_ref.dtype))
        w = pltriton.load(w_ref.at[expert, k[:, None], cols])
        return acc + jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(o_ref.at[rows[:, None], cols], acc.astype(o_ref.dtype), mask=mine)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps",
                                             "interpret"))
def grouped_matmul(x, w, group_sizes, *, block_m: int = 64, block_n: int = 64,
                   block_k: int = 64, num_warps: int = 4, interpret: bool = False):
    """x [M, K] (rows sorted by group), w float[E, K, N], group_sizes int32[E] summing to at
    most M -> [M, N] in x's dtype, rows past the groups zeros: jax.lax.ragged_dot's result.
    block_k and block_n are the largest tiles tried: each is halved (down to 16) until it
    divides K and N (`fits`)."""
    M, K = x.shape
    E, _, N = w.shape
    if not fits(K, N, block_k, block_n):
        raise ValueError(f"grouped_matmul takes K and N multiples of 16, not K={K}, N={N}")
    block_k, block_n = block_dividing(K, block_k), block_dividing(N, block_n)
    # Whole tiles: every row a tile names is a row of its own (the interpreter's masked
    # store writes each index it is given, a clamped one too).
    padded = -(-M // block_m) * block_m
    xp = jnp.pad(x, ((0, padded - M), (0, 0)))
    meta = tile_visits(group_sizes, padded, block_m)
    kernel = functools.partial(_program, block_m=block_m, block_n=block_n, block_k=block_k,
                               K=K)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((padded, N), x.dtype),
        grid=(meta.shape[1], N // block_n), interpret=interpret,
        input_output_aliases={3: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        name=f"grouped_matmul_m{block_m}_n{block_n}_k{block_k}",
    )(meta, xp, w, jnp.zeros((padded, N), x.dtype))
    return out[:M]
