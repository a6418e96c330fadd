"""The data-parallel rank a request asks for: vLLM's `X-data-parallel-rank` header, which
vllm-router (`--intra-node-data-parallel-size`), SGLang clients and RL frameworks send to pin
a request to one replica. The HTTP layer sets it for the handler's task; the data-parallel
engine reads it when the request is submitted (serving/engine/data_parallel.py). A context
variable, so the request path in between (prompt rendering, streaming) needs no extra
argument. Plain Python."""
from __future__ import annotations

from contextvars import ContextVar

HEADER = "X-data-parallel-rank"  # aiohttp's headers are case-insensitive

requested_rank: ContextVar[int | None] = ContextVar("requested_rank", default=None)


def parse_rank(text: str, data_parallel_size: int) -> int:
    """The header's rank; ValueError naming the ranks there are."""
    try:
        rank = int(text)
    except ValueError:
        rank = -1
    if not 0 <= rank < data_parallel_size:
        raise ValueError(f"{HEADER} must be a rank from 0 to {data_parallel_size - 1}, "
                         f"got {text!r}")
    return rank
