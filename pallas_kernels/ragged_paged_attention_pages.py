"""Ragged paged attention, second variant: K/V read a whole page (or several) at a time.

The first kernel (ragged_paged_attention_kernel.py) gathers keys one by one through the page
table, so its tiles need not align with pages but every key costs a page-table load and its
own address. This one follows JAX's own GPU paged-attention kernel
(jax/experimental/pallas/ops/gpu/paged_attention.py): an inner-loop tile is `pages_per_block`
whole pages, one page-table load per page, each page a [page_size, D] run of rows. Everything
else is shared with the first kernel, so one scripts/gpu_check.sh pass compares the two on the
same grid:
- program (query block b, KV head h, KV split s), query blocks from `query_blocks`;
- the tile's rows pack every query head that reads KV head h (`block_q * next_pow2(group)`
  rows, at least 16), so each K/V page is loaded once for the whole group;
- causal / sliding-window masks per row, flash-decoding splits merged by `combine_splits`,
  int8 / fp8 K/V with per-(token, head) scales applied to logits and probabilities.
Selected with attention_backend="pallas_pages" (model/attention.py).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.block_sizes import MIN_ROWS, AttentionBlockSizes, next_pow2
from pallas_kernels.ragged_paged_attention_kernel import (LOG2E, MASK_VALUE, block_sizes_for,
                                                          combine_splits, max_query_blocks,
                                                          query_blocks)


def _kernel(meta_ref, layer_ref, window_ref, q_ref, pos_ref, page_table_ref, k_ref, v_ref,
            *refs, group: int, rows_per_token: int, block_q: int, pages_per_block: int,
            head_dim: int, num_splits: int, scale: float, quantized: bool):
    """Program (query block b, KV head h, KV split s); refs as in the first kernel."""
    scale_refs = refs[:2] if quantized else None
    out_refs = refs[-(1 if num_splits == 1 else 3):]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0, n, req = meta_ref[0, b], meta_ref[1, b], meta_ref[2, b]
    layer, window = layer_ref[0], window_ref[0]
    page_size = k_ref.shape[2]

    row = jnp.arange(block_q * rows_per_token, dtype=jnp.int32)
    g = row % rows_per_token
    row_valid = (row // rows_per_token < n) & (g < group)
    tok = (t0 + row // rows_per_token)[:, None]
    head = (h * group + g)[:, None]
    padded_dim = next_pow2(max(head_dim, MIN_ROWS))
    d = jnp.arange(padded_dim, dtype=jnp.int32)
    d_valid = None if padded_dim == head_dim else d < head_dim
    q_mask = row_valid[:, None] if d_valid is None else row_valid[:, None] & d_valid[None, :]
    q = pltriton.load(q_ref.at[tok, head, d[None, :]], mask=q_mask,
                      other=jnp.zeros((), q_ref.dtype))
    pos = pltriton.load(pos_ref.at[tok[:, 0]], mask=row_valid, other=-1)  # [rows]

    # Keys [kv_lo, kv_hi) in tiles of whole pages; this split's share of the tiles.
    block_kv = pages_per_block * page_size
    kv_hi = jnp.max(pos) + 1
    first = jnp.min(jnp.where(row_valid, pos, jnp.iinfo(jnp.int32).max))
    kv_lo = jnp.minimum(jnp.where(window > 0, jnp.maximum(first - window + 1, 0), 0), kv_hi)
    tile_lo = kv_lo // block_kv
    num_tiles = (kv_hi + block_kv - 1) // block_kv - tile_lo
    per_split = (num_tiles + num_splits - 1) // num_splits
    start = tile_lo + s * per_split
    stop = jnp.minimum(start + per_split, tile_lo + num_tiles)

    tile = functools.partial(
        _attend_pages, q=q, pos=pos, win_lo=jnp.where(window > 0, pos - window + 1, 0),
        kv_lo=kv_lo, kv_hi=kv_hi, req=req, layer=layer, h=h, d=d, d_valid=d_valid,
        page_table_ref=page_table_ref, k_ref=k_ref, v_ref=v_ref, scale_refs=scale_refs,
        pages_per_block=pages_per_block, qk_scale=scale * LOG2E)
    rows = row.shape[0]
    init = (jnp.zeros((rows, padded_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(start, stop, tile, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        pltriton.store(o_ref.at[tok, head, d[None, :]], out.astype(o_ref.dtype), mask=q_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        pltriton.store(o_ref.at[s, tok, head, d[None, :]], acc, mask=q_mask)
        pltriton.store(m_ref.at[s, tok[:, 0], head[:, 0]], m, mask=row_valid)
        pltriton.store(l_ref.at[s, tok[:, 0], head[:, 0]], l, mask=row_valid)


def _attend_pages(i, carry, *, q, pos, win_lo, kv_lo, kv_hi, req, layer, h, d, d_valid,
                  page_table_ref, k_ref, v_ref, scale_refs, pages_per_block: int,
                  qk_scale: float):
    """Online softmax over pages [i * pages_per_block, (i + 1) * pages_per_block) of the
    request: keys [i * block_kv, (i + 1) * block_kv). carry as in the first kernel."""
    acc, m, l = carry
    page_size, pages_per_req = k_ref.shape[2], page_table_ref.shape[1]
    block_kv = pages_per_block * page_size
    p_idx = i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)  # [NP]
    page_used = (p_idx * page_size < kv_hi) & (p_idx < pages_per_req)
    page = pltriton.load(page_table_ref.at[req, jnp.minimum(p_idx, pages_per_req - 1)],
                         mask=page_used, other=0)  # one table load per page
    off = jnp.arange(page_size, dtype=jnp.int32)
    # [NP, page_size, D] whole pages (pages past the context are masked, never read).
    at = (layer, page[:, None, None], off[None, :, None], h, d[None, None, :])
    mask = page_used[:, None, None]
    if d_valid is not None:
        mask = mask & d_valid[None, None, :]
    mask = jnp.broadcast_to(mask, (pages_per_block, page_size, d.shape[0]))
    k = pltriton.load(k_ref.at[at], mask=mask, other=jnp.zeros((), k_ref.dtype))
    v = pltriton.load(v_ref.at[at], mask=mask, other=jnp.zeros((), v_ref.dtype))
    k = k.reshape(block_kv, d.shape[0])
    v = v.reshape(block_kv, d.shape[0])
    j = i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # key positions
    kv_valid = (j >= kv_lo) & (j < kv_hi)
    scores = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [rows, block_kv]
    if scale_refs is not None:
        ks_ref, vs_ref = scale_refs
        s_at = (layer, page[:, None], off[None, :], h)
        s_mask = jnp.broadcast_to(page_used[:, None], (pages_per_block, page_size))
        k_scale = pltriton.load(ks_ref.at[s_at], mask=s_mask, other=0.0).reshape(block_kv)
        scores = scores * k_scale[None, :]
    visible = (kv_valid[None, :] & (j[None, :] <= pos[:, None])
               & (j[None, :] >= win_lo[:, None]))
    scores = jnp.where(visible, scores * qk_scale, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(visible, jnp.exp2(scores - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    if scale_refs is not None:
        v_scale = pltriton.load(vs_ref.at[s_at], mask=s_mask, other=0.0).reshape(block_kv)
        p = p * v_scale[None, :]
    pv = jax.lax.dot_general(p.astype(q.dtype), v.astype(q.dtype), (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l


def page_block_sizes(q_shape, num_kv_heads: int, page_table_shape, page_size: int,
                     device_kind: str | None = None) -> AttentionBlockSizes:
    """The first kernel's tiles with block_kv rounded to whole pages (at least one), and the
    splits recounted in those tiles. block_kv // page_size is pages_per_block."""
    base = block_sizes_for(q_shape, num_kv_heads, page_table_shape, page_size, device_kind)
    pages = max(1, base.block_kv // page_size)
    block_kv = pages * page_size
    max_context = page_table_shape[1] * page_size
    splits = max(1, min(base.num_splits, -(-max_context // block_kv)))
    return replace(base, block_kv=block_kv, num_splits=splits)


@functools.partial(jax.jit, static_argnames=("scale", "sizes", "interpret", "poison"))
def ragged_paged_attention_pages_kernel(q, k_cache, v_cache, layer, positions, req_indices,
                                        page_table, sliding_window, scale: float,
                                        k_scale=None, v_scale=None, *,
                                        sizes: AttentionBlockSizes, interpret: bool = False,
                                        poison: bool = False):
    """Same contract as `ragged_paged_attention_reference`; sizes.block_kv must be a whole
    number of pages. poison as in the first kernel."""
    T, H, D = q.shape
    K, page_size = k_cache.shape[3], k_cache.shape[2]
    if sizes.block_kv % page_size or page_size & (page_size - 1):
        raise ValueError(f"block_kv {sizes.block_kv} must be whole pages of a power-of-two "
                         f"page size (page_size {page_size})")
    R = page_table.shape[0]
    group = H // K
    rows_per_token = next_pow2(group)
    block_q = max(sizes.block_q, -(-MIN_ROWS // rows_per_token))
    num_blocks = max_query_blocks(T, R, block_q)
    meta = query_blocks(req_indices.astype(jnp.int32), R, block_q, num_blocks)
    quantized = k_scale is not None
    if quantized != (v_scale is not None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    if interpret:  # the interpreter copies every operand per grid step: this layer only
        k_cache, v_cache = k_cache[layer][None], v_cache[layer][None]
        if quantized:
            k_scale, v_scale = k_scale[layer][None], v_scale[layer][None]
        layer = 0
    S = sizes.num_splits
    if S == 1:
        out_shape = [jax.ShapeDtypeStruct((T, H, D), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((S, T, H, D), jnp.float32),
                     jax.ShapeDtypeStruct((S, T, H), jnp.float32),
                     jax.ShapeDtypeStruct((S, T, H), jnp.float32)]
    args = [meta, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
            jnp.reshape(jnp.asarray(sliding_window, jnp.int32), (1,)), q,
            positions.astype(jnp.int32), page_table.astype(jnp.int32), k_cache, v_cache]
    if quantized:
        args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    aliases = {}
    if poison:
        aliases = {len(args) + i: i for i in range(len(out_shape))}
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    pages_per_block = sizes.block_kv // page_size
    kernel = functools.partial(
        _kernel, group=group, rows_per_token=rows_per_token, block_q=block_q,
        pages_per_block=pages_per_block, head_dim=D, num_splits=S, scale=float(scale),
        quantized=quantized)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(num_blocks, K, S), interpret=interpret,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps,
                                                num_stages=sizes.num_stages),
        name=f"ragged_paged_attention_pages_q{block_q}_np{pages_per_block}_s{S}",
    )(*args)
    return out[0] if S == 1 else combine_splits(*out, q.dtype)


def ragged_paged_attention_pages(q, k_cache, v_cache, layer, positions, req_indices,
                                 page_table, sliding_window, scale: float, k_scale=None,
                                 v_scale=None, *, interpret: bool = False,
                                 sizes: AttentionBlockSizes | None = None,
                                 poison: bool = False):
    """The page-block kernel with tiles from `page_block_sizes`; same arguments and result as
    `ragged_paged_attention_reference` (tokens sorted by request, as the engine lays them)."""
    sizes = sizes or page_block_sizes(q.shape, k_cache.shape[3], page_table.shape,
                                      k_cache.shape[2])
    return ragged_paged_attention_pages_kernel(
        q, k_cache, v_cache, layer, positions, req_indices, page_table, sliding_window, scale,
        k_scale, v_scale, sizes=sizes, interpret=interpret, poison=poison)
