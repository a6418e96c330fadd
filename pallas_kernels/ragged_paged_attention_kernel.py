"""Ragged paged attention as one Pallas kernel (Triton lowering), for decode, prefill and
chunked prefill in the same step.

Work decomposition (the grid is static; everything ragged is data):
- The flat token array is cut into query blocks: runs of at most `block_q` consecutive tokens of
  one request. Program (b, h, s) takes query block b, KV head h, KV split s. Its tile has
  `block_q * Gp` rows (Gp = next_pow2(query heads per KV head)): every query head that reads
  KV head h, so each K/V tile is loaded once for the whole group.
- The keys a block needs, [min position - window + 1, max position], are walked in tiles of
  `block_kv` keys; split s takes its share of the tiles (flash-decoding). Keys are gathered
  through the page table token by token, so tiles need not align with pages.
- Each row applies its own causal / sliding-window mask (rows may differ in position: several
  tokens of a prefill chunk, or the engine's padding tokens at position 0).
- One split: the kernel normalises and writes [T, H, D] directly. Several: it writes unnormalised
  partials (o, running max m, sum l) per split, which `combine_splits` merges in XLA.

K/V may be int8 / float8_e4m3fn with per-(token, head) float32 scales: raw values are cast to the
query dtype (exact for both formats), K scales multiply the logits and V scales the
probabilities, so the dequantised tiles are never materialised.

Soft-capping (a static cap) bends each scaled logit before the mask; sinks (float32[H]) join
the denominator when the rows are normalised: in the kernel with one split, in
`combine_splits` with several.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.block_sizes import (MIN_ROWS, AttentionBlockSizes, attention_block_sizes,
                                     next_pow2)

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf = nan
LOG2E = math.log2(math.e)


def program(meta_ref, layer_ref, window_ref, q_ref, pos_ref, page_table_ref, k_ref, v_ref,
            *refs, attend, group: int, rows_per_token: int, block_q: int, block_kv: int,
            head_dim: int, num_splits: int, scale: float, quantized: bool, soft_cap: float,
            has_sinks: bool):
    """Program (query block b, KV head h, KV split s), shared by both kernels: the tile's
    rows, its keys and this split's share of their tiles, the output. `attend(i, carry,
    **tile)` is the kernel's inner loop over tile i. refs: [k_scale, v_scale,] [sinks,]
    [aliased poison buffers,] outputs (o) or (o, m, l) partials."""
    scale_refs = refs[:2] if quantized else None
    sinks_ref = refs[2 if quantized else 0] if has_sinks else None
    out_refs = refs[-(1 if num_splits == 1 else 3):]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0, n, req = meta_ref[0, b], meta_ref[1, b], meta_ref[2, b]
    layer, window = layer_ref[0], window_ref[0]

    # Rows: block_q tokens x the (padded) query heads of KV head h. Rows past the block or the
    # group point past them, masked: never clamped onto a valid row (the interpreter's masked
    # store writes every index it is given).
    row = jnp.arange(block_q * rows_per_token, dtype=jnp.int32)
    g = row % rows_per_token
    row_valid = (row // rows_per_token < n) & (g < group)
    tok = (t0 + row // rows_per_token)[:, None]
    head = (h * group + g)[:, None]
    padded_dim = next_pow2(max(head_dim, MIN_ROWS))
    d = jnp.arange(padded_dim, dtype=jnp.int32)
    # Head dims that are not powers of two are padded and masked; others get no lane mask (a
    # constant-true one could still cost Triton its vectorised loads).
    d_valid = None if padded_dim == head_dim else d < head_dim
    q_mask = row_valid[:, None] if d_valid is None else row_valid[:, None] & d_valid[None, :]
    q = pltriton.load(q_ref.at[tok, head, d[None, :]], mask=q_mask,
                      other=jnp.zeros((), q_ref.dtype))
    pos = pltriton.load(pos_ref.at[tok[:, 0]], mask=row_valid, other=-1)  # [rows]

    # Keys the block needs: up to its last position, from its first position's window; this
    # split's share of their tiles.
    kv_hi = jnp.max(pos) + 1  # 0 for an empty block
    first = jnp.min(jnp.where(row_valid, pos, jnp.iinfo(jnp.int32).max))
    kv_lo = jnp.minimum(jnp.where(window > 0, jnp.maximum(first - window + 1, 0), 0), kv_hi)
    tile_lo = kv_lo // block_kv
    num_tiles = (kv_hi + block_kv - 1) // block_kv - tile_lo
    per_split = (num_tiles + num_splits - 1) // num_splits
    start = tile_lo + s * per_split
    stop = jnp.minimum(start + per_split, tile_lo + num_tiles)

    tile = functools.partial(
        attend, q=q, pos=pos, win_lo=jnp.where(window > 0, pos - window + 1, 0),
        kv_lo=kv_lo, kv_hi=kv_hi, req=req, layer=layer, h=h, d=d, d_valid=d_valid,
        page_table_ref=page_table_ref, k_ref=k_ref, v_ref=v_ref, scale_refs=scale_refs,
        qk_scale=scale * LOG2E, soft_cap=soft_cap * LOG2E)
    rows = row.shape[0]
    init = (jnp.zeros((rows, padded_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(start, stop, tile, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        if sinks_ref is not None:
            sink = pltriton.load(sinks_ref.at[head[:, 0]], mask=row_valid, other=0.0) * LOG2E
            acc, l = add_sink(acc, m, l, sink)
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        pltriton.store(o_ref.at[tok, head, d[None, :]], out.astype(o_ref.dtype), mask=q_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        pltriton.store(o_ref.at[s, tok, head, d[None, :]], acc, mask=q_mask)
        pltriton.store(m_ref.at[s, tok[:, 0], head[:, 0]], m, mask=row_valid)
        pltriton.store(l_ref.at[s, tok[:, 0], head[:, 0]], l, mask=row_valid)


def add_sink(acc, m, l, sink):
    """A row's sink logit (log2 domain) into its unnormalised (acc, running max m, sum l), as
    one more key whose value is zero -> (acc, l) on the new max's scale."""
    m_new = jnp.maximum(m, sink)
    alpha = jnp.exp2(m - m_new)
    return acc * alpha[..., None], l * alpha + jnp.exp2(sink - m_new)


def softmax_step(scores, j, kv_valid, pos, win_lo, m, l, qk_scale: float, soft_cap: float):
    """One tile's online-softmax update, shared by both kernels: scores f32[rows, n] of keys
    at positions j [n] (kv_valid: inside the block's range), scaled to the log2 domain,
    soft-capped where soft_cap (log2 units) is not 0, masked causally and by the window per
    row -> (probabilities, new running max, new sum, the old terms' rescale)."""
    visible = (kv_valid[None, :] & (j[None, :] <= pos[:, None])
               & (j[None, :] >= win_lo[:, None]))
    scores = scores * qk_scale
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(visible, jnp.exp2(scores - m_new[:, None]), 0.0)
    return p, m_new, l * alpha + jnp.sum(p, axis=1), alpha


def _attend_tile(i, carry, *, q, pos, win_lo, kv_lo, kv_hi, req, layer, h, d, d_valid,
                 page_table_ref, k_ref, v_ref, scale_refs, block_kv: int, qk_scale: float,
                 soft_cap: float):
    """Online softmax over keys [i * block_kv, (i + 1) * block_kv), gathered through the page
    table. carry: (acc f32[rows, D], running max m f32[rows] (log2 domain), sum l f32[rows])."""
    acc, m, l = carry
    d = d[None, :]
    with_d = lambda mask: mask if d_valid is None else mask & d_valid[None, :]  # noqa: E731
    page_size, pages_per_req = k_ref.shape[2], page_table_ref.shape[1]
    j = i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # key positions
    kv_valid = (j >= kv_lo) & (j < kv_hi)
    page = pltriton.load(page_table_ref.at[req, jnp.minimum(j // page_size, pages_per_req - 1)],
                         mask=kv_valid, other=0)
    off = j % page_size
    kv_mask = with_d(kv_valid[:, None])
    at = (layer, page[:, None], off[:, None], h, d)
    k = pltriton.load(k_ref.at[at], mask=kv_mask, other=jnp.zeros((), k_ref.dtype))
    v = pltriton.load(v_ref.at[at], mask=kv_mask, other=jnp.zeros((), v_ref.dtype))
    scores = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [rows, block_kv]
    if scale_refs is not None:  # quantized K/V: dequantise the logits, not the tile
        ks_ref, vs_ref = scale_refs
        scores = scores * pltriton.load(ks_ref.at[layer, page, off, h], mask=kv_valid,
                                        other=0.0)[None, :]
    p, m_new, l, alpha = softmax_step(scores, j, kv_valid, pos, win_lo, m, l, qk_scale,
                                      soft_cap)
    if scale_refs is not None:
        p = p * pltriton.load(vs_ref.at[layer, page, off, h], mask=kv_valid, other=0.0)[None, :]
    pv = jax.lax.dot_general(p.astype(q.dtype), v.astype(q.dtype), (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l


def query_blocks(req_indices, num_reqs: int, block_q: int, num_blocks: int):
    """int32[3, num_blocks]: (first token, token count, request) of each query block.

    Tokens must be sorted by request (the engine's layout: requests in page-table order, padding
    tokens last with request R-1). Unused blocks have count 0.
    req_indices: int32[T].
    """
    r = jnp.arange(num_reqs, dtype=jnp.int32)
    starts = jnp.sum(req_indices[None, :] < r[:, None], axis=1, dtype=jnp.int32)  # [R]
    ends = jnp.sum(req_indices[None, :] <= r[:, None], axis=1, dtype=jnp.int32)
    blocks = (ends - starts + block_q - 1) // block_q
    last = jnp.cumsum(blocks)  # blocks of requests 0..r
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    req = jnp.sum(last[None, :] <= b[:, None], axis=1, dtype=jnp.int32)  # [num_blocks]
    used = req < num_reqs
    req_c = jnp.minimum(req, num_reqs - 1)
    t0 = starts[req_c] + (b - (last[req_c] - blocks[req_c])) * block_q
    n = jnp.where(used, jnp.clip(ends[req_c] - t0, 0, block_q), 0)
    return jnp.stack([jnp.where(used, t0, 0), n, req_c]).astype(jnp.int32)


def max_query_blocks(num_tokens: int, num_reqs: int, block_q: int) -> int:
    return min(num_tokens, num_tokens // block_q + num_reqs)


def combine_splits(o, m, l, dtype, sinks=None):
    """Merges flash-decoding partials. o: f32[S, T, H, D]; m, l: f32[S, T, H] -> dtype[T, H, D].
    sinks: float32[H] or None, joining the merged denominator."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp2(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    o_all = jnp.sum(w[..., None] * o, axis=0)
    if sinks is not None:
        o_all, l_all = add_sink(o_all, m_all, l_all, sinks.astype(jnp.float32)[None] * LOG2E)
    out = o_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]
    return out.astype(dtype)


# jit: one traced program per static configuration, shared by every layer that calls it.
@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sizes", "interpret",
                                             "poison"))
def ragged_paged_attention_kernel(q, k_cache, v_cache, layer, positions, req_indices,
                                  page_table, sliding_window, scale: float,
                                  k_scale=None, v_scale=None, *, sizes: AttentionBlockSizes,
                                  sinks=None, soft_cap: float = 0.0,
                                  interpret: bool = False, poison: bool = False):
    """Same contract as `ragged_paged_attention_reference` (q: [T, H, D] -> [T, H, D]).

    poison: (tests) the outputs start as NaN buffers aliased into the kernel, so an element the
    kernel fails to write shows, on a GPU as in the interpreter.
    """
    attend = functools.partial(_attend_tile, block_kv=sizes.block_kv)
    return launch(attend, "ragged_paged_attention", q, k_cache, v_cache, layer, positions,
                  req_indices, page_table, sliding_window, scale, k_scale, v_scale, sizes=sizes,
                  sinks=sinks, soft_cap=soft_cap, interpret=interpret, poison=poison)


def launch(attend, name: str, q, k_cache, v_cache, layer, positions, req_indices, page_table,
           sliding_window, scale: float, k_scale, v_scale, *, sizes: AttentionBlockSizes,
           sinks, soft_cap: float, interpret: bool, poison: bool, tile_name: str = ""):
    """One `pallas_call` of `program` with the kernel's inner loop `attend`; shared by both
    kernels. Returns [T, H, D] in q's dtype."""
    T, H, D = q.shape
    K = k_cache.shape[3]
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
    if sinks is not None and S == 1:  # with splits, combine_splits adds them
        args.append(sinks.astype(jnp.float32))
    aliases = {}
    if poison:
        aliases = {len(args) + i: i for i in range(len(out_shape))}
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    kernel = functools.partial(
        program, attend=attend, group=group, rows_per_token=rows_per_token, block_q=block_q,
        block_kv=sizes.block_kv, head_dim=D, num_splits=S, scale=float(scale),
        quantized=quantized, soft_cap=float(soft_cap), has_sinks=sinks is not None and S == 1)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(num_blocks, K, S), interpret=interpret,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps,
                                                num_stages=sizes.num_stages),
        name=f"{name}_q{block_q}_{tile_name or f'kv{sizes.block_kv}'}_s{S}",
    )(*args)
    return out[0] if S == 1 else combine_splits(*out, q.dtype, sinks)


@functools.cache
def _device() -> tuple[str | None, int | None]:
    """(device_kind, SM count) of the first GPU, or (None, None) without one."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return None, None
    return dev.device_kind, getattr(dev, "core_count", None)


def block_sizes_for(q_shape, num_kv_heads: int, page_table_shape, page_size: int,
                    device_kind: str | None = None) -> AttentionBlockSizes:
    """The tiles `ragged_paged_attention` uses for these (static) shapes."""
    T, H, D = q_shape
    R, P = page_table_shape
    kind, cores = _device()
    return attention_block_sizes(
        num_tokens=T, num_reqs=R, max_context=P * page_size, num_kv_heads=num_kv_heads,
        group=H // num_kv_heads, head_dim=D, device_kind=device_kind or kind, num_cores=cores)


def ragged_paged_attention(q, k_cache, v_cache, layer, positions, req_indices, page_table,
                           sliding_window, scale: float, k_scale=None, v_scale=None, *,
                           sinks=None, soft_cap: float = 0.0, interpret: bool = False,
                           sizes: AttentionBlockSizes | None = None, poison: bool = False):
    """The kernel with its tiles chosen by pallas_kernels.block_sizes for these shapes.

    Same arguments and result as `ragged_paged_attention_reference`. Precondition (the engine's
    batch layout): tokens sorted by request, each request's tokens contiguous.
    """
    sizes = sizes or block_sizes_for(q.shape, k_cache.shape[3], page_table.shape,
                                     k_cache.shape[2])
    return ragged_paged_attention_kernel(
        q, k_cache, v_cache, layer, positions, req_indices, page_table, sliding_window, scale,
        k_scale, v_scale, sizes=sizes, sinks=sinks, soft_cap=soft_cap, interpret=interpret,
        poison=poison)
