"""The decoder-only transformer of the Llama / Mistral / Qwen2 / Qwen3 families, in Flax.

`forward(params, cache, batch, cfg)` is a pure function: it returns the logits of the tokens
named by `batch.logits_indices` and the cache with this step's keys and values written in.
The layers run under `nn.scan`, so a program's compile time does not grow with depth.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import paged_attention
from model.batch import Batch
from model.config import ModelConfig
from model.kv_cache import KVCache, write_kv
from model.layers import MLP, Linear, RMSNorm, apply_rope, embed, matmul, rope_inv_freq


class Attention(nn.Module):
    cfg: ModelConfig
    backend: str

    @nn.compact
    def __call__(self, x, cache: KVCache, layer, window, batch: Batch):
        cfg = self.cfg
        T = x.shape[0]
        q = Linear(cfg.q_size, cfg.qkv_bias, cfg.dtype, name="q_proj")(x)
        k = Linear(cfg.kv_size, cfg.qkv_bias, cfg.dtype, name="k_proj")(x)
        v = Linear(cfg.kv_size, cfg.qkv_bias, cfg.dtype, name="v_proj")(x)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="k_norm")(k)
        inv_freq = rope_inv_freq(cfg)
        q = apply_rope(q, batch.positions, inv_freq)
        k = apply_rope(k, batch.positions, inv_freq)
        cache = write_kv(cache, layer, k, v, batch.slot_mapping)
        out = paged_attention(q, cache, layer, batch, window, cfg.head_dim ** -0.5, self.backend)
        out = Linear(cfg.hidden_size, cfg.o_bias, cfg.dtype, name="o_proj")(
            out.reshape(T, cfg.q_size))
        return out, cache


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    backend: str

    @nn.compact
    def __call__(self, carry, layer, window, batch: Batch):
        x, cache = carry
        cfg = self.cfg
        h = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="input_norm")(x)
        h, cache = Attention(cfg, self.backend, name="attn")(h, cache, layer, window, batch)
        x = x + h
        h = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="post_norm")(x)
        x = x + MLP(cfg, name="mlp")(h)
        return (x, cache), None


class Transformer(nn.Module):
    cfg: ModelConfig
    backend: str = "reference"

    @nn.compact
    def __call__(self, batch: Batch, cache: KVCache):
        cfg = self.cfg
        embedding = self.param("embed", nn.initializers.normal(0.02),
                               (cfg.vocab_size, cfg.hidden_size), cfg.dtype)
        x = embed(embedding, batch.input_ids, cfg.dtype)
        layers = nn.scan(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, 0, nn.broadcast), length=cfg.num_layers)
        windows = jnp.asarray(cfg.sliding_windows or (0,) * cfg.num_layers, jnp.int32)
        (x, cache), _ = layers(cfg, self.backend, name="layers")(
            (x, cache), jnp.arange(cfg.num_layers, dtype=jnp.int32), windows, batch)
        x = x[batch.logits_indices]
        x = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="final_norm")(x)
        if cfg.tie_word_embeddings:
            logits = matmul(x, embedding.T)
        else:
            logits = Linear(cfg.vocab_size, False, cfg.dtype, name="lm_head")(x)
        return logits.astype(jnp.float32), cache


def forward(params, cache: KVCache, batch: Batch, cfg: ModelConfig, backend: str = "reference"):
    """-> (logits float32[R, V], new cache). Pure: jit it with the cache donated."""
    return Transformer(cfg, backend).apply({"params": params}, batch, cache)


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random weights in the model's dtype (for tests and dummy-weight benchmarks)."""
    batch = Batch(*(jnp.zeros((1,), jnp.int32) for _ in range(4)),
                  jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))
    cache = KVCache.zeros(cfg, 1, 1)
    return jax.jit(lambda key: Transformer(cfg).init(key, batch, cache)["params"])(
        jax.random.PRNGKey(seed))
