"""A request's KV pages out of the paged cache into arrays (producer) and back into other
pages (consumer), as tpu-inference's TPUConnector moves them: one array per cache leaf (K, V
and, for an int8/fp8 cache, their scales), pages on axis 1, every layer.

Page counts are padded to a power of two with the sink page (page 0, which padded tokens
write anyway), so one compiled gather and one scatter serve every request of a size class
and the pulled arrays' shape follows from the page count alone.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model.kv_cache import KVCache

LEAVES = ("k", "v", "k_scale", "v_scale")


def padded_count(num_pages: int) -> int:
    return 1 << max(num_pages - 1, 0).bit_length()


def padded_ids(page_ids: list[int]) -> np.ndarray:
    ids = np.zeros(padded_count(len(page_ids)), np.int32)  # 0: the sink page
    ids[:len(page_ids)] = page_ids
    return ids


def layout(cache: KVCache) -> list:
    """What must match for pages to move between two caches: each leaf's shape past the page
    axis and its dtype (layers, page size, kv heads, head dim; storage and scales)."""
    return [[name, [leaf.shape[0], *leaf.shape[2:]], str(leaf.dtype)]
            for name, leaf in _leaves(cache).items()]


def specs(cache_layout: list, num_pages: int, device) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays a pull of num_pages pages receives, on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    n = padded_count(num_pages)
    return {name: jax.ShapeDtypeStruct((shape[0], n, *shape[1:]), jnp.dtype(dtype),
                                       sharding=sharding)
            for name, shape, dtype in cache_layout}


def _leaves(cache: KVCache) -> dict[str, jax.Array]:
    return {name: getattr(cache, name) for name in LEAVES if getattr(cache, name) is not None}


@jax.jit
def _gather(cache: KVCache, ids):
    return {name: leaf[:, ids] for name, leaf in _leaves(cache).items()}


@partial(jax.jit, donate_argnums=(0,))
def _scatter(cache: KVCache, ids, arrays):
    return replace(cache, **{name: leaf.at[:, ids].set(arrays[name])
                             for name, leaf in _leaves(cache).items()})


def gather(cache: KVCache, page_ids: list[int]) -> dict[str, jax.Array]:
    """Copies of the pages' K/V (padded with the sink page), launched, not waited for."""
    return _gather(cache, padded_ids(page_ids))


def scatter(cache: KVCache, page_ids: list[int], arrays: dict[str, jax.Array]) -> KVCache:
    """The cache with the arrays' first len(page_ids) pages written into page_ids; the rest
    of the padding lands on the sink page. The cache is donated."""
    return _scatter(cache, padded_ids(page_ids), arrays)
