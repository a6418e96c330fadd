"""Embeddings on the host: which rows of a step the pooling program normalises, and one
request's rows gathered across the chunks of its prefill, pooled, truncated and normalised.
Numpy, no JAX (the device side is serving.engine.pooling).

A request's vector depends only on its own rows, each written once per position (a chunk
recomputed after a preemption writes the same values), and is pooled once, after its last
chunk: so it is the same, bit for bit, however the prefill was chunked or batched.
"""
from __future__ import annotations

import numpy as np

from serving.core.pooling_params import PoolingParams
from serving.core.scheduler import ScheduledRequest


def is_pooling(s: ScheduledRequest) -> bool:
    return s.request.pooling_params is not None


def _chunk_rows(kind: str, s: ScheduledRequest) -> tuple[int, int]:
    """(first, end) offsets inside this chunk of the rows `kind` pools."""
    n, last = s.num_new_tokens, s.request.num_prompt_tokens - 1
    if kind == "MEAN":
        return 0, n
    position = last if kind == "LAST" else 0
    if s.start <= position < s.start + n:
        return position - s.start, position - s.start + 1
    return 0, 0


def pooling_rows(sched: list[ScheduledRequest], T: int, kind: str) -> np.ndarray | None:
    """-> bool[T]: the step's tokens whose final hidden state some request pools; None when
    no request of the step pools any."""
    rows, t = np.zeros(T, bool), 0
    for s in sched:
        if is_pooling(s):
            first, end = _chunk_rows(kind, s)
            rows[t + first:t + end] = True
        t += s.num_new_tokens
    return rows if rows.any() else None


class EmbeddingCollector:
    """One request's pooled rows, filled chunk by chunk, then its vector."""

    def __init__(self, num_prompt_tokens: int, kind: str, params: PoolingParams):
        self.kind, self.params = kind, params
        self.rows: np.ndarray | None = None  # f32[P, H] for MEAN, else f32[1, H]
        self._num_rows = num_prompt_tokens if kind == "MEAN" else 1

    def add(self, s: ScheduledRequest, row_start: int, hidden: np.ndarray) -> None:
        """hidden: f32[T, H] the step's final-normed hidden states (rows it did not ask for
        may be zeros); row_start: where this request's tokens begin in the step."""
        first, end = _chunk_rows(self.kind, s)
        if first == end:
            return
        if self.rows is None:
            self.rows = np.zeros((self._num_rows, hidden.shape[1]), np.float32)
        at = s.start + first if self.kind == "MEAN" else 0
        self.rows[at:at + end - first] = hidden[row_start + first:row_start + end]

    def embedding(self) -> list[float]:
        """The vector: pooled, cut to `dimensions`, then normalised (vLLM's order)."""
        if self.rows is None:
            raise RuntimeError("the request finished before its rows were pooled")
        v = self.rows.mean(0, dtype=np.float64) if self.kind == "MEAN" \
            else self.rows[0].astype(np.float64)
        if self.params.dimensions is not None:
            v = v[:self.params.dimensions]
        if self.params.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32).tolist()
