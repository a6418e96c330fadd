"""Batch: the flat, bucket-padded description of one step that crosses to the device."""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class Batch:
    input_ids: jax.Array  # int32[T]
    positions: jax.Array  # int32[T] position of each token in its sequence
    slot_mapping: jax.Array  # int32[T] cache slot written by each token (page * page_size + off)
    req_indices: jax.Array  # int32[T] page_table row of each token
    page_table: jax.Array  # int32[B, pages_per_req]
    logits_indices: jax.Array  # int32[R] tokens whose logits are computed (one per request)
    # int32[T] each token's LoRA slot (model/lora.py; -1: none); None: LoRA off
    lora_slots: jax.Array | None = None
    # A hybrid model's window layers (model/kv_groups.py): their own page table and the
    # slots this step writes there; None: every layer uses page_table and slot_mapping.
    window_page_table: jax.Array | None = None  # int32[B, pages_per_req]
    window_slot_mapping: jax.Array | None = None  # int32[T]
    # A linear-attention hybrid (model/linear_attention/): each row's state slot (0, the
    # null slot, for padded rows) and where each row's tokens start (int32[B + 1]: row r's
    # are query_start[r] .. query_start[r + 1] - 1; tokens from query_start[B] on are
    # padding). None: no linear layer.
    state_slots: jax.Array | None = None  # int32[B]
    query_start: jax.Array | None = None  # int32[B + 1]

    def window_view(self) -> "Batch":
        """The batch as a window layer of a hybrid model reads it."""
        return replace(self, page_table=self.window_page_table,
                       slot_mapping=self.window_slot_mapping)


def sequences_batch(tokens: list[list[int]], page_table: np.ndarray, page_size: int,
                    start: list[int] | None = None) -> Batch:
    """An unpadded numpy Batch of whole sequences (or continuations of them from `start`),
    with logits for every token. For tests and tools; the engine builds its own batches."""
    start = start or [0] * len(tokens)
    ids, pos, slots, reqs = [], [], [], []
    for i, (toks, s0) in enumerate(zip(tokens, start)):
        for j, t in enumerate(toks):
            p = s0 + j
            ids += [t]
            pos += [p]
            slots += [int(page_table[i, p // page_size]) * page_size + p % page_size]
            reqs += [i]
    as32 = lambda x: np.asarray(x, np.int32)
    return Batch(as32(ids), as32(pos), as32(slots), as32(reqs), as32(page_table),
                 as32(np.arange(len(ids))))
