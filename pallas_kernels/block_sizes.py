"""Every kernel tile size is chosen here: sane defaults, overridden per GPU kind once measured.

The ragged paged-attention kernel runs one program per (query block, KV head, KV split):
- `block_q` query tokens of one request share a program; with the query heads of one KV head
  they make `block_q * next_pow2(group)` rows of the score tile (at least 16: Triton's dot).
- `block_kv` keys per inner-loop step (any power of two >= 16; independent of the page size,
  keys are gathered token by token through the page table).
- `num_splits` KV partitions per query block (flash-decoding): small batches of long contexts
  still fill the GPU; partial results are combined in XLA. 1 for prefill-sized steps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

MIN_ROWS = 16  # Triton's tensor-core dot needs M, N, K >= 16
DEFAULT_NUM_CORES = 132  # H100/H200 SXM streaming multiprocessors
MAX_SPLITS = 32


@dataclass(frozen=True)
class AttentionBlockSizes:
    block_q: int  # query tokens per program
    block_kv: int  # keys per inner-loop tile
    num_splits: int  # KV partitions per query block
    num_warps: int = 4
    num_stages: int = 2


# Measured overrides, keyed by jax Device.device_kind, then by "decode" / "prefill": field ->
# value, e.g. {"NVIDIA H200": {"decode": {"block_kv": 128, "num_stages": 3}}}. Fill them from
# the "best for" lines of `scripts/bench_kernels.py --tune` on that GPU. (Leave num_splits out:
# the default scales it with the batch.) Empty until measured.
TUNED: dict[str, dict[str, dict[str, int]]] = {}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_decode_step(num_tokens: int, num_reqs: int) -> bool:
    """The engine pads requests to at least min(tokens, max_num_seqs), so a step with more
    token slots than request slots must carry prefill chunks; otherwise it is (mostly)
    decode and is tiled for it: tiny query blocks, many KV splits."""
    return num_tokens <= num_reqs


def attention_block_sizes(*, num_tokens: int, num_reqs: int, max_context: int,
                          num_kv_heads: int, group: int, head_dim: int,
                          device_kind: str | None = None,
                          num_cores: int | None = None) -> AttentionBlockSizes:
    """Tiles for one bucket shape (all arguments static).

    max_context: pages per request x page size (the longest history this bucket can hold).
    group: query heads per KV head.
    """
    rows_per_token = next_pow2(group)
    decode = is_decode_step(num_tokens, num_reqs)
    rows = MIN_ROWS if decode else 64
    block_q = max(1, rows // rows_per_token)
    block_kv = 64 if head_dim >= 128 else 128
    block_kv = max(16, min(block_kv, next_pow2(max_context)))
    num_splits = 1
    if decode:
        # Enough programs to give every SM a few, without splitting below one tile each.
        cores = num_cores or DEFAULT_NUM_CORES
        programs = max(1, min(num_reqs, num_tokens)) * num_kv_heads
        want = next_pow2(-(-4 * cores // programs))
        num_splits = max(1, min(want, MAX_SPLITS, -(-max_context // block_kv)))
    sizes = AttentionBlockSizes(block_q, block_kv, num_splits,
                                num_warps=4 if head_dim <= 64 or decode else 8,
                                num_stages=2)
    tuned = TUNED.get(device_kind or "", {}).get("decode" if decode else "prefill")
    return replace(sizes, **tuned) if tuned else sizes


# --- multi-head latent attention (pallas_kernels/latent_attention_pallas.py) -------------------
# One KV "head" of width W = R + Dr read by all H query heads: a program takes `block_h` query
# heads of `block_q` tokens and streams the request's latent rows once for all of them.
# Measured overrides go in TUNED under "mla_decode" / "mla_prefill" (fields of
# LatentAttentionBlockSizes), from `scripts/bench_mla_decode.py --tune`.
# Flash-decoding partials are float32 [S, T, H, R]: more splits than this share of the latent
# bytes a token reads would make writing and re-reading them cost more than they save.
MAX_PARTIAL_SHARE = 0.5


@dataclass(frozen=True)
class LatentAttentionBlockSizes:
    block_q: int  # query tokens per program
    block_h: int  # query heads per program, all fed by each latent row read (power of two)
    block_kv: int  # latent rows per inner-loop tile
    num_splits: int  # KV partitions per (query block, head block)
    num_warps: int = 4
    num_stages: int = 2


def latent_attention_block_sizes(*, num_tokens: int, num_reqs: int, max_context: int,
                                 num_heads: int, value_dim: int, width: int,
                                 cache_itemsize: int, device_kind: str | None = None,
                                 num_cores: int | None = None) -> LatentAttentionBlockSizes:
    """Tiles for one MLA bucket shape (all static). value_dim: R, the latent columns that are
    also the value; width: W = R + Dr. The float32 accumulator is [rows, R] (R = 512 for V3),
    so rows stay at 16 for decode (4 warps) and 32 otherwise (8 warps)."""
    decode = is_decode_step(num_tokens, num_reqs)
    rows = MIN_ROWS if decode else 2 * MIN_ROWS
    block_h = min(next_pow2(num_heads), rows)
    block_q = max(1, rows // block_h)
    block_kv = 32 if value_dim >= 256 else 64
    block_kv = max(16, min(block_kv, next_pow2(max_context)))
    num_splits = 1
    if decode:
        cores = num_cores or DEFAULT_NUM_CORES
        programs = max(1, min(num_reqs, num_tokens)) * -(-num_heads // block_h)
        want = next_pow2(-(-4 * cores // programs))
        partial_bytes = 2 * num_heads * value_dim * 4  # one split's partials, written + read
        latent_bytes = max_context * width * cache_itemsize
        cap = max(1, int(MAX_PARTIAL_SHARE * latent_bytes // partial_bytes))
        cap = 1 << (cap.bit_length() - 1)  # largest power of two not above it
        num_splits = max(1, min(want, cap, MAX_SPLITS, -(-max_context // block_kv)))
    sizes = LatentAttentionBlockSizes(block_q, block_h, block_kv, num_splits,
                                      num_warps=4 if rows <= MIN_ROWS else 8, num_stages=2)
    tuned = TUNED.get(device_kind or "", {}).get("mla_decode" if decode else "mla_prefill")
    return replace(sizes, **tuned) if tuned else sizes
