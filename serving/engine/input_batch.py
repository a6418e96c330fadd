"""A decode step's arrays from the step before it.

Most steps of a busy engine decode one token for each of the same running requests, in the
same order, as the step before. Such a step's arrays differ from the last one's only in what
moves a token at a time: the input tokens, their positions and cache slots, the rows of the
page tables whose pages changed, and each row's output index (the sampler's seed counter).
`InputBatch` keeps the last decode step's arrays and their requests, and builds the next
step from them with those few operations; everything else (the sampling table, the row
indices, logit-bias arrays, LoRA slots) is the last step's arrays, shared, never written
after they are built. A step that is not such a decode (a prefill chunk, a new or
preempted request, proposed tokens, penalties, a grammar's or min_tokens' mask, prompt
logprobs, pooling, a new page bucket) is built whole by `input_prep.prepare`, which stays
the definition of every array: tests/test_input_batch.py checks the two agree step for step.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import numpy as np

from serving.core.buckets import Buckets
from serving.core.request import Request
from serving.core.scheduler import ScheduledRequest, SchedulerOutput
from serving.engine.input_prep import (StepArrays, page_table_rows, prepare, prev_rows_array,
                                       slots_array)


@dataclass
class _Kept:
    """The last decode step: its requests, the page lists it was built from, its arrays."""
    requests: list[Request]
    pages: list[list[int]]
    window_pages: list[list[int]] | None
    lora_slots: list[int] | None
    arrays: StepArrays


def _decodes(sched: list[ScheduledRequest]) -> bool:
    """Every request runs one known-position token and samples one row."""
    return all(s.num_new_tokens == 1 and not s.spec_token_ids for s in sched)


class InputBatch:
    """Builds each step's arrays (`prepare`), reusing the last decode step's where it can.
    bitmask_width, pooling_type: as input_prep.prepare takes them."""

    def __init__(self, buckets: Buckets, page_size: int, max_num_seqs: int,
                 bitmask_width: int = 0, pooling_type: str | None = None):
        self.buckets, self.page_size, self.max_num_seqs = buckets, page_size, max_num_seqs
        self.bitmask_width, self.pooling_type = bitmask_width, pooling_type
        self._kept: _Kept | None = None
        self.reused = 0  # steps built from the last one (for benchmarks and tests)

    def prepare(self, out: SchedulerOutput, lora_slots: list[int] | None = None,
                prev_rows: dict[str, int] | None = None,
                shape: tuple[int, int, int] | None = None) -> StepArrays:
        """The step's arrays, equal to input_prep.prepare's for the same arguments."""
        sched = out.scheduled
        decodes = self.pooling_type is None and _decodes(sched)
        arrays = (self._next(sched, lora_slots, prev_rows)
                  if decodes and self._kept is not None else None)
        if arrays is not None and shape is not None and arrays.shape != shape:
            arrays = None
        if arrays is None:
            arrays = prepare(out, self.buckets, self.page_size, self.max_num_seqs,
                             self.bitmask_width, self.pooling_type, lora_slots, prev_rows,
                             shape)
        else:
            self.reused += 1
        # Kept only when its arrays carry nothing that changes with each token's value
        # (a penalised row's history, a mask) or with the prompt (prompt logprobs).
        keep = (decodes and arrays.history is None and arrays.bitmask is None
                and arrays.prompt_targets is None)
        self._kept = _Kept([s.request for s in sched], [s.page_ids for s in sched],
                           _window_pages(sched), lora_slots, arrays) if keep else None
        return arrays

    def _next(self, sched: list[ScheduledRequest], lora_slots: list[int] | None,
              prev_rows: dict[str, int] | None) -> StepArrays | None:
        """The step from the kept one, or None when it does not decode the same requests
        in the same bucket."""
        kept = self._kept
        if (len(sched) != len(kept.requests) or lora_slots != kept.lora_slots
                or not all(map(operator.is_, (s.request for s in sched), kept.requests))):
            return None
        last = kept.arrays
        T, R, P = last.shape
        pages = [s.page_ids for s in sched]
        if self.buckets.pad_pages(max(max(map(len, pages)), 1)) != P:
            return None
        n = len(sched)
        req = np.arange(n, dtype=np.int32)
        positions = np.zeros(T, np.int32)
        positions[:n] = [s.start for s in sched]
        pos = positions[:n]
        input_ids = np.zeros(T, np.int32)
        input_ids[:n] = [s.token_ids[0] for s in sched]
        table = _updated(last.batch["page_table"], pages, kept.pages)
        batch = dict(last.batch, input_ids=input_ids, positions=positions, page_table=table,
                     slot_mapping=slots_array(table, req, pos, T, self.page_size),
                     prev_rows=prev_rows_array(sched, input_ids, req, T, prev_rows))
        window = _window_pages(sched)
        if window is not None:
            wtable = _updated(last.batch["window_page_table"], window, kept.window_pages)
            batch.update(window_page_table=wtable,
                         window_slot_mapping=slots_array(wtable, req, pos, T, self.page_size))
        output_index = np.zeros(R, np.int32)
        output_index[:n] = [s.request.num_output_tokens for s in sched]
        return dataclasses.replace(last, batch=batch,
                                   sampling=dict(last.sampling, output_index=output_index))


def _window_pages(sched: list[ScheduledRequest]) -> list[list[int]] | None:
    if not sched or sched[0].window_page_ids is None:
        return None
    return [s.window_page_ids for s in sched]


def _updated(table: np.ndarray, pages: list[list[int]], last: list[list[int]]) -> np.ndarray:
    """The page table with the rows whose page list changed written again (a copy when any
    did: the last step's table is never written)."""
    changed = [i for i, (now, before) in enumerate(zip(pages, last)) if now != before]
    if not changed:
        return table
    table = table.copy()
    table[changed] = page_table_rows([pages[i] for i in changed], len(changed),
                                     table.shape[1])
    return table
