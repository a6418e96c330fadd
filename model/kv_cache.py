"""The paged KV cache: K and V pages for every layer, and how new keys are written into it.

K and V may be stored as int8 or float8_e4m3fn (`kv_cache_dtype`), each (token, kv head)
vector with its own float32 absmax scale in `k_scale` / `v_scale`: real value = stored * scale.

A latent-attention model (DeepSeek; model/latent_attention.py) stores one latent a token and
layer in `k` ([L, P, page_size, 1, kv_lora_rank + rope dims], with one scale a token when
quantized: the key and its value, the latent's first part, share it); `v` and `v_scale` are
then empty ([..., 0]), so every step and transfer handles the cache as it handles any other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.kv_groups import num_group_layers
from model.linear_attention.state import RecurrentState
from quant.array import quantize

# kv_cache_dtype (one of KV_CACHE_DTYPES) -> storage dtype; "auto" (or None) stores K/V in
# the model's dtype. A float dtype stores them rounded to it (a float32 model with a float16
# cache, as llama.cpp's default).
QUANTIZED_KV = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def kv_storage_dtype(cfg: ModelConfig, kv_cache_dtype=None):
    """(storage dtype, quantized?) of a cache of kv_cache_dtype (None / "auto": cfg.dtype)."""
    if kv_cache_dtype in (None, "auto"):
        return jnp.dtype(cfg.dtype), False
    if kv_cache_dtype in QUANTIZED_KV:
        return jnp.dtype(QUANTIZED_KV[kv_cache_dtype]), True
    dtype = jnp.dtype(kv_cache_dtype)
    return dtype, dtype in (jnp.dtype(d) for d in QUANTIZED_KV.values())


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, K, D]
    v: jax.Array  # [L, P, page_size, K, D]
    k_scale: jax.Array | None = None  # float32[L, P, page_size, K] when k/v are int8 / fp8
    v_scale: jax.Array | None = None
    # A hybrid model's window layers (model/kv_groups.py): their own cache, on pages of
    # their own; then k / v above hold the full-attention layers only. None: one cache.
    window: "KVCache | None" = None
    # A linear-attention hybrid's linear layers (model/linear_attention/state.py): a state
    # slot per running request; then k / v above hold the attention layers only.
    state: RecurrentState | None = None

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def shape(cfg: ModelConfig, num_pages: int, page_size: int,
              num_layers: int | None = None) -> tuple[int, ...]:
        layers = cfg.num_kv_layers if num_layers is None else num_layers
        if cfg.latent:
            return (layers, num_pages, page_size, 1, cfg.latent_width)
        return (layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype=None,
              window_pages: int = 0, state_slots: int = 0, ssm_dtype: str | None = None
              ) -> "KVCache":
        """dtype: a kv_cache_dtype ("auto", "int8", "fp8") or a dtype; None: cfg.dtype.
        window_pages > 0 (a hybrid model): the window layers get a cache of that many pages
        of their own, and num_pages are the full-attention layers'. A model with linear
        layers gets a RecurrentState of state_slots slots (the null slot included; at
        least 1), its delta-rule state in ssm_dtype (None: the config's)."""
        state = (RecurrentState.zeros(cfg, max(state_slots, 1), ssm_dtype)
                 if cfg.num_linear_layers else None)
        if window_pages:
            full, window = num_group_layers(cfg)
            return replace(cls._zeros(cfg, num_pages, page_size, dtype, full),
                           window=cls._zeros(cfg, window_pages, page_size, dtype, window),
                           state=state)
        return replace(cls._zeros(cfg, num_pages, page_size, dtype, cfg.num_kv_layers),
                       state=state)

    @classmethod
    def _zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype,
               num_layers: int) -> "KVCache":
        shape = cls.shape(cfg, num_pages, page_size, num_layers)
        dtype, quantized = kv_storage_dtype(cfg, dtype)
        if cfg.latent:
            empty = shape[:-1] + (0,)
            if not quantized:
                return cls(jnp.zeros(shape, dtype), jnp.zeros(empty, dtype))
            return cls(jnp.zeros(shape, dtype), jnp.zeros(empty, dtype),
                       jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(empty[:-1] + (0,),
                                                                      jnp.float32))
        if not quantized:
            return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape[:-1], jnp.float32))


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype=None,
                   num_layers: int | None = None) -> int:
    """K and V bytes of one page over all layers (or num_layers of them), scales included.
    dtype as in zeros."""
    dtype, quantized = kv_storage_dtype(cfg, dtype)
    scale_bytes = cfg.num_kv_heads * 4 if quantized else 0
    layers = cfg.num_kv_layers if num_layers is None else num_layers
    if cfg.latent:  # one latent (and one scale) a token and layer
        return layers * page_size * (cfg.latent_width * dtype.itemsize + scale_bytes)
    return 2 * layers * page_size * (cfg.kv_size * dtype.itemsize + scale_bytes)


def write_kv(cache: KVCache, layer, k, v, slot_mapping) -> KVCache:
    """Scatters this step's keys and values into their slots.

    k, v: [T, K, D]; slot_mapping: int32[T] = page * page_size + offset (padding -> sink page).
    """
    page_size = cache.page_size
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    if cache.k_scale is not None:
        return _write_quantized(cache, layer, pages, offsets, k, v)
    return KVCache(cache.k.at[layer, pages, offsets].set(k.astype(cache.k.dtype)),
                   cache.v.at[layer, pages, offsets].set(v.astype(cache.v.dtype)))


def _write_quantized(cache: KVCache, layer, pages, offsets, k, v) -> KVCache:
    """One absmax scale per (token, kv head) vector of D values."""
    kq = quantize(k, cache.k.dtype, axes=(-1,))
    vq = quantize(v, cache.v.dtype, axes=(-1,))
    at = (layer, pages, offsets)
    return KVCache(cache.k.at[at].set(kq.values), cache.v.at[at].set(vq.values),
                   cache.k_scale.at[at].set(kq.scale[..., 0]),
                   cache.v_scale.at[at].set(vq.scale[..., 0]))


def write_latent(cache: KVCache, layer, latent, slot_mapping) -> KVCache:
    """A latent-attention step's latents [T, 1, W] into their slots (padding -> sink page);
    quantized with one absmax scale a token, which the rope key shares with the latent."""
    pages, offsets = slot_mapping // cache.page_size, slot_mapping % cache.page_size
    at = (layer, pages, offsets)
    if cache.k_scale is None:
        return replace(cache, k=cache.k.at[at].set(latent.astype(cache.k.dtype)))
    q = quantize(latent, cache.k.dtype, axes=(-1,))
    return replace(cache, k=cache.k.at[at].set(q.values),
                   k_scale=cache.k_scale.at[at].set(q.scale[..., 0]))
