"""The paged KV cache: K and V pages for every layer, and how new keys are written into it."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, K, D]
    v: jax.Array  # [L, P, page_size, K, D]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
        return (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> "KVCache":
        shape = cls.shape(cfg, num_pages, page_size)
        dtype = dtype or cfg.dtype
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype=None) -> int:
    itemsize = np.dtype(jnp.dtype(dtype or cfg.dtype)).itemsize
    return 2 * cfg.num_layers * page_size * cfg.kv_size * itemsize


def write_kv(cache: KVCache, layer, k, v, slot_mapping) -> KVCache:
    """Scatters this step's keys and values into their slots.

    k, v: [T, K, D]; slot_mapping: int32[T] = page * page_size + offset (padding -> sink page).
    """
    page_size = cache.page_size
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    return KVCache(cache.k.at[layer, pages, offsets].set(k.astype(cache.k.dtype)),
                   cache.v.at[layer, pages, offsets].set(v.astype(cache.v.dtype)))
