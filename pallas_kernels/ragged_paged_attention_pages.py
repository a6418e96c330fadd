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
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.block_sizes import AttentionBlockSizes
from pallas_kernels.ragged_paged_attention_kernel import block_sizes_for, launch, softmax_step


def _attend_pages(i, carry, *, q, pos, win_lo, kv_lo, kv_hi, req, layer, h, d, d_valid,
                  page_table_ref, k_ref, v_ref, scale_refs, pages_per_block: int,
                  qk_scale: float, soft_cap: float):
    """Online softmax over pages [i * pages_per_block, (i + 1) * pages_per_block) of the
    request: keys [i * block_kv, (i + 1) * block_kv). Arguments as in the first kernel's
    `_attend_tile`."""
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
    p, m_new, l, alpha = softmax_step(scores, j, kv_valid, pos, win_lo, m, l, qk_scale,
                                      soft_cap)
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


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sizes", "interpret",
                                             "poison"))
def ragged_paged_attention_pages_kernel(q, k_cache, v_cache, layer, positions, req_indices,
                                        page_table, sliding_window, scale: float,
                                        k_scale=None, v_scale=None, *,
                                        sizes: AttentionBlockSizes, sinks=None,
                                        soft_cap: float = 0.0, interpret: bool = False,
                                        poison: bool = False):
    """Same contract as `ragged_paged_attention_reference`; sizes.block_kv must be a whole
    number of pages. poison as in the first kernel."""
    page_size = k_cache.shape[2]
    if sizes.block_kv % page_size or page_size & (page_size - 1):
        raise ValueError(f"block_kv {sizes.block_kv} must be whole pages of a power-of-two "
                         f"page size (page_size {page_size})")
    pages_per_block = sizes.block_kv // page_size
    attend = functools.partial(_attend_pages, pages_per_block=pages_per_block)
    return launch(attend, "ragged_paged_attention_pages", q, k_cache, v_cache, layer,
                  positions, req_indices, page_table, sliding_window, scale, k_scale, v_scale,
                  sizes=sizes, sinks=sinks, soft_cap=soft_cap, interpret=interpret,
                  poison=poison, tile_name=f"np{pages_per_block}")


def ragged_paged_attention_pages(q, k_cache, v_cache, layer, positions, req_indices,
                                 page_table, sliding_window, scale: float, k_scale=None,
                                 v_scale=None, *, sinks=None, soft_cap: float = 0.0,
                                 interpret: bool = False,
                                 sizes: AttentionBlockSizes | None = None,
                                 poison: bool = False):
    """The page-block kernel with tiles from `page_block_sizes`; same arguments and result as
    `ragged_paged_attention_reference` (tokens sorted by request, as the engine lays them)."""
    sizes = sizes or page_block_sizes(q.shape, k_cache.shape[3], page_table.shape,
                                      k_cache.shape[2])
    return ragged_paged_attention_pages_kernel(
        q, k_cache, v_cache, layer, positions, req_indices, page_table, sliding_window, scale,
        k_scale, v_scale, sizes=sizes, sinks=sinks, soft_cap=soft_cap, interpret=interpret,
        poison=poison)
