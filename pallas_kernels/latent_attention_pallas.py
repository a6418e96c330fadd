"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over latent pages: a Pallas kernel
(Triton lowering) aimed at decode, and its pure-jnp reference.

In the absorbed form MLA is MQA with one KV "head" of width W = R + Dr shared by all H query
heads: a cached row is [c (R latent values) | k_rot (Dr rope values)], the query is
[q_lat | q_rot], score = q_lat . c + q_rot . k_rot, and the value is c itself. The cache holds
only that row (~1 KiB a token a layer for V3), so decode is bound by reading it, and the point
of a kernel is to read each row once for many heads.

Work decomposition (static grid, ragged data, as in ragged_paged_attention_kernel.py):
- program (head block hb, KV split s, query block b); the head-block axis is the launch's
  fastest, so the programs that read the same latent rows run side by side and share them
  through L2;
- its tile has `block_q * block_h` rows: block_q consecutive tokens of one request (from
  `query_blocks`) x block_h query heads. Each latent tile [block_kv, W] is loaded once for
  all of them, in two parts, because W (576 for V3) is no power of two for Triton: the R
  value columns and the Dr rope columns, each padded to a power of two and masked;
- keys 0..max position of the block are walked in tiles of block_kv rows gathered through the
  page table (tiles need not align with pages); split s takes its share (flash-decoding);
- online softmax in float32 (log2 domain); the output accumulates over the R value columns
  only, never the rope columns. With one split the kernel normalises and writes [T, H, R];
  with several it writes partials that `combine_splits` merges in XLA.

Quantized caches (int8 / float8_e4m3fn) carry one float32 scale per token row, shared by the
key and value parts (the value is the key's latent): raw values are cast to the query dtype
(exact for both formats), the scale multiplies the logits and then the probabilities.
A token with a negative position (padding) sees no key and gets zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.block_sizes import (MIN_ROWS, LatentAttentionBlockSizes,
                                     latent_attention_block_sizes, next_pow2)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_kernel import (
    LOG2E, MASK_VALUE, _device, combine_splits, max_query_blocks, query_blocks, softmax_step)


def latent_paged_attention_reference(q, latent, layer, positions, req_indices, page_table,
                                     scale: float, latent_scale=None, *, value_dim: int,
                                     interpret: bool = False, sizes=None):
    """The specification: paged attention with V = K over the latent cache, the output cut to
    the first value_dim columns, zeros for padding tokens (negative positions).

    q: [T, H, W]; latent: [L, P, page_size, 1, W]; latent_scale: float32[L, P, page_size, 1]
    or None; layer: int32 scalar; positions, req_indices: int32[T];
    page_table: int32[B, pages_per_req] -> [T, H, value_dim] in q.dtype.
    (interpret and sizes are accepted and ignored, so either function can be passed.)
    """
    del interpret, sizes
    out = ragged_paged_attention_reference(q, latent, latent, layer, positions, req_indices,
                                           page_table, jnp.int32(0), scale, latent_scale,
                                           latent_scale)[..., :value_dim]
    return jnp.where(positions[:, None, None] >= 0, out, jnp.zeros((), out.dtype))


def _columns(start: int, width: int):
    """Column indices [start, start + width) padded to a power of two (at least 16, Triton's
    dot) and their mask, None when no padding: -> (int32[padded], bool[padded] | None)."""
    padded = next_pow2(max(width, MIN_ROWS))
    d = jnp.arange(padded, dtype=jnp.int32)
    return start + d, (None if padded == width else d < width)


def _and(mask, cols_valid):
    """mask [n, 1] with a column mask [padded] (or none)."""
    return mask if cols_valid is None else mask & cols_valid[None, :]


def _program(meta_ref, layer_ref, q_ref, pos_ref, page_table_ref, latent_ref, *refs,
             block_q: int, block_h: int, block_kv: int, num_heads: int, value_dim: int,
             rope_dim: int, num_splits: int, scale: float, quantized: bool):
    """Program (head block hb, KV split s, query block b). refs: [latent_scale,] [aliased
    poison buffers,] outputs (o) or (o, m, l) partials."""
    scale_ref = refs[0] if quantized else None
    out_refs = refs[-(1 if num_splits == 1 else 3):]
    hb, s, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0, n, req = meta_ref[0, b], meta_ref[1, b], meta_ref[2, b]
    layer = layer_ref[0]

    # Rows: block_q tokens x block_h heads. Rows past the block or past H are masked and point
    # past them, never clamped onto another row of this tile.
    row = jnp.arange(block_q * block_h, dtype=jnp.int32)
    tok = t0 + row // block_h
    head = hb * block_h + row % block_h
    row_valid = (row // block_h < n) & (head < num_heads)
    tok, head, rmask = tok[:, None], head[:, None], row_valid[:, None]
    val, val_ok = _columns(0, value_dim)  # the latent c: key part and value
    rot, rot_ok = _columns(value_dim, rope_dim)
    zero_q = jnp.zeros((), q_ref.dtype)
    q_lat = pltriton.load(q_ref.at[tok, head, val[None, :]], mask=_and(rmask, val_ok),
                          other=zero_q)  # [rows, Rp]
    q_rot = None
    if rope_dim:
        q_rot = pltriton.load(q_ref.at[tok, head, rot[None, :]], mask=_and(rmask, rot_ok),
                              other=zero_q)  # [rows, Drp]
    pos = pltriton.load(pos_ref.at[tok[:, 0]], mask=row_valid, other=-1)  # [rows]

    # Keys 0..the block's last position; this split's share of their tiles.
    kv_hi = jnp.maximum(jnp.max(pos) + 1, 0)  # 0 for a block of padding tokens
    num_tiles = (kv_hi + block_kv - 1) // block_kv
    per_split = (num_tiles + num_splits - 1) // num_splits
    start = s * per_split
    stop = jnp.minimum(start + per_split, num_tiles)

    tile = functools.partial(
        _attend_tile, q_lat=q_lat, q_rot=q_rot, pos=pos, kv_hi=kv_hi, req=req, layer=layer,
        cols=(val, val_ok, rot, rot_ok), page_table_ref=page_table_ref, latent_ref=latent_ref,
        scale_ref=scale_ref, block_kv=block_kv, qk_scale=scale * LOG2E)
    rows = row.shape[0]
    init = (jnp.zeros((rows, val.shape[0]), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(start, stop, tile, init)

    o_at = (tok, head, val[None, :])
    o_mask = _and(rmask, val_ok)
    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        pltriton.store(o_ref.at[o_at], out.astype(o_ref.dtype), mask=o_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        pltriton.store(o_ref.at[(s, *o_at)], acc, mask=o_mask)
        pltriton.store(m_ref.at[s, tok[:, 0], head[:, 0]], m, mask=row_valid)
        pltriton.store(l_ref.at[s, tok[:, 0], head[:, 0]], l, mask=row_valid)


def _attend_tile(i, carry, *, q_lat, q_rot, pos, kv_hi, req, layer, cols, page_table_ref,
                 latent_ref, scale_ref, block_kv: int, qk_scale: float):
    """Online softmax over latent rows [i * block_kv, (i + 1) * block_kv) of the request.
    carry: (acc f32[rows, Rp], running max m f32[rows] (log2 domain), sum l f32[rows])."""
    acc, m, l = carry
    val, val_ok, rot, rot_ok = cols
    page_size, pages_per_req = latent_ref.shape[2], page_table_ref.shape[1]
    j = i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # key positions
    kv_valid = j < kv_hi
    page = pltriton.load(page_table_ref.at[req, jnp.minimum(j // page_size, pages_per_req - 1)],
                         mask=kv_valid, other=0)
    off = j % page_size
    row_at = (layer, page[:, None], off[:, None], 0)
    zero = jnp.zeros((), latent_ref.dtype)
    kv_mask = kv_valid[:, None]
    dtype = q_lat.dtype
    c = pltriton.load(latent_ref.at[(*row_at, val[None, :])], mask=_and(kv_mask, val_ok),
                      other=zero).astype(dtype)  # [block_kv, Rp]
    nt = (((1,), (1,)), ((), ()))
    scores = jax.lax.dot_general(q_lat, c, nt, preferred_element_type=jnp.float32)
    if q_rot is not None:
        k_rot = pltriton.load(latent_ref.at[(*row_at, rot[None, :])],
                              mask=_and(kv_mask, rot_ok), other=zero).astype(dtype)
        scores = scores + jax.lax.dot_general(q_rot, k_rot, nt,
                                              preferred_element_type=jnp.float32)
    if scale_ref is not None:  # one scale per row: dequantise the logits, not the tile
        row_scale = pltriton.load(scale_ref.at[layer, page, off, 0], mask=kv_valid, other=0.0)
        scores = scores * row_scale[None, :]
    p, m_new, l, alpha = softmax_step(scores, j, kv_valid, pos, jnp.zeros_like(pos), m, l,
                                      qk_scale, 0.0)
    if scale_ref is not None:
        p = p * row_scale[None, :]
    pv = jax.lax.dot_general(p.astype(dtype), c, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [rows, Rp]
    return acc * alpha[:, None] + pv, m_new, l


# jit: one traced program per static configuration, shared by every layer that calls it.
@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "sizes", "interpret",
                                             "poison"))
def latent_paged_attention_kernel(q, latent, layer, positions, req_indices, page_table,
                                  scale: float, latent_scale=None, *, value_dim: int,
                                  sizes: LatentAttentionBlockSizes, interpret: bool = False,
                                  poison: bool = False):
    """Same contract as `latent_paged_attention_reference`, with explicit tiles.

    poison: (tests) the outputs start as NaN buffers aliased into the kernel, so an element the
    kernel fails to write shows, on a GPU as in the interpreter.
    """
    T, H, W = q.shape
    if latent.shape[3:] != (1, W):
        raise ValueError(f"latent {latent.shape} must be [L, P, page_size, 1, {W}] for q "
                         f"{q.shape}")
    if not 0 < value_dim <= W:
        raise ValueError(f"value_dim {value_dim} must be in 1..{W}")
    if sizes.block_h & (sizes.block_h - 1):
        raise ValueError(f"block_h {sizes.block_h} must be a power of two")
    R = page_table.shape[0]
    block_q = max(sizes.block_q, -(-MIN_ROWS // sizes.block_h))
    num_blocks = max_query_blocks(T, R, block_q)
    meta = query_blocks(req_indices.astype(jnp.int32), R, block_q, num_blocks)
    quantized = latent_scale is not None
    if interpret:  # the interpreter copies every operand per grid step: this layer only
        latent = latent[layer][None]
        latent_scale = latent_scale[layer][None] if quantized else None
        layer = 0
    S, head_blocks = sizes.num_splits, -(-H // sizes.block_h)
    if S == 1:
        out_shape = [jax.ShapeDtypeStruct((T, H, value_dim), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((S, T, H, value_dim), jnp.float32),
                     jax.ShapeDtypeStruct((S, T, H), jnp.float32),
                     jax.ShapeDtypeStruct((S, T, H), jnp.float32)]
    args = [meta, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), q,
            positions.astype(jnp.int32), page_table.astype(jnp.int32), latent]
    if quantized:
        args.append(latent_scale.astype(jnp.float32))
    aliases = {}
    if poison:
        aliases = {len(args) + i: i for i in range(len(out_shape))}
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    kernel = functools.partial(
        _program, block_q=block_q, block_h=sizes.block_h, block_kv=sizes.block_kv,
        num_heads=H, value_dim=value_dim, rope_dim=W - value_dim, num_splits=S,
        scale=float(scale), quantized=quantized)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(head_blocks, S, num_blocks), interpret=interpret,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps,
                                                num_stages=sizes.num_stages),
        name=f"latent_paged_attention_q{block_q}_h{sizes.block_h}_kv{sizes.block_kv}_s{S}",
    )(*args)
    return out[0] if S == 1 else combine_splits(*out, q.dtype)


def latent_block_sizes_for(q_shape, page_table_shape, page_size: int, value_dim: int,
                           cache_dtype, device_kind: str | None = None
                           ) -> LatentAttentionBlockSizes:
    """The tiles `latent_paged_attention` uses for these (static) shapes."""
    T, H, W = q_shape
    R, P = page_table_shape
    kind, cores = _device()
    return latent_attention_block_sizes(
        num_tokens=T, num_reqs=R, max_context=P * page_size, num_heads=H, value_dim=value_dim,
        width=W, cache_itemsize=jnp.dtype(cache_dtype).itemsize,
        device_kind=device_kind or kind, num_cores=cores)


def latent_paged_attention(q, latent, layer, positions, req_indices, page_table,
                           scale: float, latent_scale=None, *, value_dim: int,
                           interpret: bool = False,
                           sizes: LatentAttentionBlockSizes | None = None,
                           poison: bool = False):
    """MLA decode/prefill over latent pages, tiles from pallas_kernels.block_sizes unless
    `sizes` is given. Same arguments and result as `latent_paged_attention_reference`
    (q: [T, H, W] -> [T, H, value_dim]); the first value_dim columns of a row are the value
    (R), the rest the rope key (Dr = W - value_dim). Precondition (the engine's batch layout):
    tokens sorted by request, each request's tokens contiguous."""
    sizes = sizes or latent_block_sizes_for(q.shape, page_table.shape, latent.shape[2],
                                            value_dim, latent.dtype)
    return latent_paged_attention_kernel(
        q, latent, layer, positions, req_indices, page_table, scale, latent_scale,
        value_dim=value_dim, sizes=sizes, interpret=interpret, poison=poison)
