"""KV cache events in vLLM's wire format: what a replica's prefix cache gained and lost, so a
KV-aware router (vllm-router's `kv_aware` policy, llm-d's precise prefix-cache scorer) can
send a request where its prefix is cached. Plain Python, no JAX.

- **BlockStored**: full pages just made findable (`KVCacheManager.cache_computed`): their
  hashes, the hash of the page before them (None when the run starts the sequence), their
  token ids concatenated. Consumers never reproduce our hash: they key pages by hashing
  `token_ids` themselves and keep our hash only to apply later removals, so the tokens are
  what matters and the router's block size must equal our page size.
- **BlockRemoved**: hashes the page allocator forgot (a free cached page handed out again,
  or a reset). **AllBlocksCleared**: the prefix cache was reset.
- **Hashes** are the low 64 bits of our sha256 page hash as an unsigned int, as vLLM sends
  them by default (`maybe_convert_block_hash`, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
- **medium** is "GPU" for our one tier, the accelerator's KV cache, whatever the device: it is
  the name routers know for "device memory" (vLLM's offload tiers say "CPU"), and llm-d
  weighs a hit by it, the device tier highest.
- **group_idx**: 0 for the full-attention pages, 1 for a hybrid model's window pages
  (core/kv_hybrid.py), with the group's kind and window as vLLM reports its KV cache groups.

Encoding (msgpack, as vLLM's msgspec structs encode): a batch is the array
`[ts, events, data_parallel_rank]`. An event is a tagged map `{"type": "BlockStored", ...}`
from vLLM 0.24 on (fields at their default left out, the fields vLLM gives no default always
present), or a tagged array `["BlockStored", field, ...]` with every field, in declaration
order, up to vLLM 0.23 (core/kv_events_config.py, `event_encoding`).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

try:
    import msgspec
except ImportError:  # needed only to publish events (engine/kv_event_publisher.py checks)
    msgspec = None

MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"  # vLLM's KVCacheSpecKind values
SLIDING_WINDOW = "sliding_window"


def external_hash(page_hash: bytes) -> int:
    """The hash events carry: the low 64 bits of the page hash (vLLM's
    maybe_convert_block_hash)."""
    return int.from_bytes(page_hash, "big") & (2**64 - 1)


# Field order is the wire order of the array encoding: it follows vLLM's declarations.
@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None  # deprecated in vLLM; we have no integer adapter ids
    medium: str | None
    lora_name: str | None
    # Per page: what else vLLM's hash mixes in (the adapter's name, cache_salt on the
    # first page), or None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float  # time.time() when the step's events were handed over
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch, encoding: str = "map") -> bytes:
    """The batch's msgpack bytes; encoding "map" (vLLM >= 0.24) or "array" (<= 0.23)."""
    to_wire = _as_map if encoding == "map" else _as_array
    return msgspec.msgpack.encode([batch.ts, [to_wire(e) for e in batch.events],
                                   batch.data_parallel_rank])


def _as_array(event: KVCacheEvent) -> list:
    return [type(event).__name__, *(getattr(event, f.name) for f in fields(event))]


def _as_map(event: KVCacheEvent) -> dict:
    """msgspec's omit_defaults: a field with a default is left out while it holds it."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.default is MISSING or value != f.default:
            out[f.name] = value
    return out


class KVEventRecorder:
    """One KV cache group's events, appended as they happen to a list the engine drains
    after each step (a hybrid model's two groups share one list, so the order holds across
    them). A manager records only while one is attached: with events off nothing grows."""

    def __init__(self, events: list, block_size: int, group_idx: int = 0,
                 sliding_window: int = 0):
        self.events = events
        self.block_size = block_size
        self.group_idx = group_idx
        self.spec_kind = SLIDING_WINDOW if sliding_window else FULL_ATTENTION
        self.sliding_window = sliding_window or None

    def stored(self, req, indices: list[int], hashes: list[bytes]) -> None:
        """req's pages at these page-table indices (ascending) were just cached under
        hashes[i]: one BlockStored per run of consecutive pages, its parent the hash of the
        page before the run (a page left out of a run is cached elsewhere already)."""
        lora_name = getattr(req.lora, "name", None) or None
        salt = req.sampling_params.cache_salt
        for start, end in _runs(indices):
            extra = [tuple(([lora_name] if lora_name else [])
                           + ([salt] if i == 0 and salt else [])) or None
                     for i in range(start, end)]
            self.events.append(BlockStored(
                block_hashes=[external_hash(h) for h in hashes[start:end]],
                parent_block_hash=external_hash(hashes[start - 1]) if start else None,
                token_ids=req.slice_token_ids(start * self.block_size, end * self.block_size),
                block_size=self.block_size, lora_id=None, medium=MEDIUM_GPU,
                lora_name=lora_name, extra_keys=extra, group_idx=self.group_idx,
                kv_cache_spec_kind=self.spec_kind,
                kv_cache_spec_sliding_window=self.sliding_window))

    def removed(self, page_hash: bytes) -> None:
        """The allocator forgot page_hash. Removals in a row share one event."""
        h = external_hash(page_hash)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.group_idx == self.group_idx:
            last.block_hashes.append(h)
        else:
            self.events.append(BlockRemoved([h], MEDIUM_GPU, self.group_idx))

    def cleared(self) -> None:
        """The prefix cache was reset (its removals recorded just before). The event names
        the whole cache, so with nothing stored since the last one (a hybrid model's first
        group) that one moves here: one event, after every group's removals."""
        for i in range(len(self.events) - 1, -1, -1):
            if isinstance(self.events[i], AllBlocksCleared):
                del self.events[i]
                break
            if isinstance(self.events[i], BlockStored):
                break
        self.events.append(AllBlocksCleared())


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive integers: [1, 2, 4] -> [(1, 3), (4, 5)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
