"""The single attention dispatch point: every layer's attention over the paged cache goes here.

Model code never picks a backend; `backend` comes from the engine's configuration.
"""
from __future__ import annotations

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

BACKENDS = ("reference",)


def resolve_backend(name: str) -> str:
    """'auto' -> the best backend for the default device; other names are checked."""
    if name == "auto":
        return "reference"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, "
                         + ", ".join(BACKENDS))
    return name


def paged_attention(q, cache, layer, batch, sliding_window, scale: float,
                    backend: str = "reference"):
    """q: [T, H, D] -> [T, H, D], attending over `cache` (already holding this step's K/V)."""
    if backend == "reference":
        return ragged_paged_attention_reference(
            q, cache.k, cache.v, layer, batch.positions, batch.req_indices, batch.page_table,
            sliding_window, scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
