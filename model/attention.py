"""The single attention dispatch point: every layer's attention over the paged cache goes here.

Model code never picks a backend; `backend` comes from the engine's configuration:
- "reference": pure jnp (pallas_kernels.ragged_paged_attention), any device: the spec.
- "cpu": a C++ kernel called through the XLA FFI (pallas_kernels.ragged_paged_attention_cpu);
  what "auto" picks off-GPU where it builds (g++ and an x86-64 AVX2/FMA CPU).
- "blocked": plain XLA shaped for CPUs (pallas_kernels.ragged_paged_attention_blocked); what
  "auto" picks off-GPU where the C++ kernel is unavailable.
- "pallas": the ragged paged-attention Pallas kernel (Triton lowering); compiled on a GPU,
  run by the Pallas interpreter elsewhere (slow: for tests).
- "pallas_pages": its second variant (pallas_kernels.ragged_paged_attention_pages), which
  reads K/V a whole page (or several) at a time; the first GPU run compares the two.
"""
from __future__ import annotations

import jax

from model.config import ATTENTION_BACKENDS
from pallas_kernels import cpu_ffi, latent_attention_pallas
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_blocked import ragged_paged_attention_blocked
from pallas_kernels.ragged_paged_attention_cpu import ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention_kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_pages import ragged_paged_attention_pages

BACKENDS = ATTENTION_BACKENDS
# Backends whose kernel reads only the pages a token can see: a page table wider than the
# step needs costs them nothing, so the engine compiles one width (the widest) for them.
# "reference" and "blocked" gather every page of the table.
FIXED_PAGE_TABLE = ("cpu", "pallas")

# None: interpret the Pallas kernels unless the default backend is a GPU. Tests that
# cross-lower for CUDA on a CPU host set it to False.
PALLAS_INTERPRET: bool | None = None


def resolve_backend(name: str) -> str:
    """'auto' -> the best backend for the default device; other names are checked."""
    if name == "auto":
        if jax.default_backend() == "gpu":
            return "pallas"
        return "cpu" if cpu_ffi.available("paged_attention") else "blocked"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, "
                         + ", ".join(BACKENDS))
    return name


def pallas_interpret() -> bool:
    if PALLAS_INTERPRET is not None:
        return PALLAS_INTERPRET
    return jax.default_backend() != "gpu"


def paged_attention(q, cache, layer, batch, sliding_window, scale: float,
                    backend: str = "reference", *, sinks=None, soft_cap: float = 0.0):
    """q: [T, H, D] -> [T, H, D], attending over `cache` (already holding this step's K/V).

    A cache with `k_scale` / `v_scale` (float32[L, P, page_size, K]) holds quantized K/V.
    Every backend takes the layer's variants: `sinks` (float32[H] logits in the softmax's
    denominator, gpt-oss) and `soft_cap` (static; scores capped as cap * tanh(s / cap),
    Gemma 2); see pallas_kernels/ragged_paged_attention.py.
    """
    args = (q, cache.k, cache.v, layer, batch.positions, batch.req_indices, batch.page_table,
            sliding_window, scale, getattr(cache, "k_scale", None),
            getattr(cache, "v_scale", None))
    variants = dict(sinks=sinks, soft_cap=float(soft_cap))
    if backend == "reference":
        return ragged_paged_attention_reference(*args, **variants)
    if backend == "blocked":
        return ragged_paged_attention_blocked(*args, **variants)
    if backend == "cpu":
        return ragged_paged_attention_cpu(*args, **variants)
    if backend == "pallas":
        return ragged_paged_attention(*args, **variants, interpret=pallas_interpret())
    if backend == "pallas_pages":
        return ragged_paged_attention_pages(*args, **variants, interpret=pallas_interpret())
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def latent_paged_attention(q, cache, layer, batch, scale: float, backend: str = "reference", *,
                           value_dim: int):
    """Latent attention (model/latent_attention.py): q [T, H, W] against the latent cache
    (cache.k [L, P, page_size, 1, W], one key shared by every head) -> [T, H, value_dim].
    The value is the key's first value_dim entries (the latent). On GPUs the Pallas backends
    take the latent kernel (pallas_kernels/latent_attention_pallas.py: each latent row read
    once for a block of heads, in two power-of-two parts). The others run as multi-query
    attention with the latent passed as both keys and values and the output's first
    value_dim columns kept: the cache is read once, as those kernels read K and V rows of
    one token together."""
    k_scale = getattr(cache, "k_scale", None)
    if backend in ("pallas", "pallas_pages"):
        return latent_attention_pallas.latent_paged_attention(
            q, cache.k, layer, batch.positions, batch.req_indices, batch.page_table, scale,
            k_scale, value_dim=value_dim, interpret=pallas_interpret())
    args = (q, cache.k, cache.k, layer, batch.positions, batch.req_indices, batch.page_table,
            jax.numpy.int32(0), scale, k_scale, k_scale)
    if backend == "reference":
        out = ragged_paged_attention_reference(*args)
    elif backend == "blocked":
        out = ragged_paged_attention_blocked(*args)
    elif backend == "cpu":
        out = ragged_paged_attention_cpu(*args)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of "
                         f"{', '.join(BACKENDS)}")
    return out[..., :value_dim]
