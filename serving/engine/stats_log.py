"""The periodic stats line while serving, as vLLM logs it: requests running and waiting,
prompt and generation throughput, KV cache usage and the prefix cache hit rate."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.engine.async_engine import EngineStats

log = logging.getLogger("xlaserve")


def format_stats(now: "EngineStats", before: "EngineStats | None", seconds: float) -> str:
    """One line for the interval from `before` (None: since start) to `now`."""
    def delta(name: str) -> int:
        return getattr(now, name) - (getattr(before, name) if before else 0)

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    if queries == 0:  # nothing looked up in this interval: the rate so far
        queries, hits = now.prefix_cache_queries, now.prefix_cache_hits
    hit_rate = f"{100 * hits / queries:.1f}%" if queries else "n/a"
    seconds = max(seconds, 1e-9)
    return (f"Running: {now.num_running} reqs, Waiting: {now.num_waiting} reqs, "
            f"Avg prompt throughput: {delta('num_prompt_tokens_total') / seconds:.1f} tokens/s, "
            f"Avg generation throughput: "
            f"{delta('num_generation_tokens_total') / seconds:.1f} tokens/s, "
            f"KV cache usage: {100 * now.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate}" + _spec_stats(now, before))


def _spec_stats(now: "EngineStats", before: "EngineStats | None") -> str:
    """vLLM's speculative decoding figures over the interval: the share of proposed tokens
    accepted, tokens per verifying step (accepted + 1) and the rate at each position."""
    if now.spec is None:
        return ""
    prev = before.spec if before is not None and before.spec is not None else None
    drafts = now.spec.num_drafts - (prev.num_drafts if prev else 0)
    proposed = now.spec.num_draft_tokens - (prev.num_draft_tokens if prev else 0)
    accepted = now.spec.num_accepted_tokens - (prev.num_accepted_tokens if prev else 0)
    if drafts == 0:
        return ", Spec decode draft acceptance rate: n/a"
    old = prev.accepted_per_pos if prev else []
    per_pos = [(n - (old[i] if i < len(old) else 0)) / drafts
               for i, n in enumerate(now.spec.accepted_per_pos)]
    return (f", Spec decode draft acceptance rate: {100 * accepted / max(proposed, 1):.1f}%, "
            f"mean acceptance length: {1 + accepted / drafts:.2f}, per-position acceptance "
            "rate: " + " ".join(f"{r:.2f}" for r in per_pos))


class StatsLogger:
    """Logs a line at most every interval_s, and only when something ran since the last."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self._last_time = clock()
        self._last: EngineStats | None = None

    def maybe_log(self, stats: "EngineStats") -> str | None:
        now = self.clock()
        if now - self._last_time < self.interval_s:
            return None
        active = stats.num_running or stats.num_waiting or self._last is None or (
            stats.num_generation_tokens_total != self._last.num_generation_tokens_total
            or stats.num_prompt_tokens_total != self._last.num_prompt_tokens_total)
        line = format_stats(stats, self._last, now - self._last_time) if active else None
        if line:
            log.info(line)
        self._last_time, self._last = now, stats
        return line
