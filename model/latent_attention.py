"""Multi-head latent attention (MLA: DeepSeek-V2, V3, R1, Kimi K2), an attention kind of the
decoder beside model/transformer.py's `Attention`.

Per token, `kv_a_proj` gives kv_lora_rank values, normed into the latent c, and one rope key
k_rot shared by every head; the cache holds [c | k_rot] (model/kv_cache.py), one entry a
token and layer. transformers expands every cached latent into per-head keys and values
(`kv_b_proj`); we never do: with kv_b_proj's rows for head h split into W_UK_h [nope, r] and
W_UV_h [v, r] (`k_up`, `v_up`, split at load),

    q_nope_h . (W_UK_h c) = (q_nope_h W_UK_h) . c      and      sum_s p_s W_UV_h c_s = W_UV_h sum_s p_s c_s,

so attention runs over the latent itself: one key of kv_lora_rank + rope dims shared by all
H query heads (q_lat_h = q_nope_h W_UK_h, then q_rot_h), the value being the latent's first
kv_lora_rank values, and each head's output goes through W_UV_h after. The softmax scale
stays (nope + rope dims) ** -0.5 (with YaRN's mscale_all_dim folded in: ModelConfig). This
one form serves prefill and decode alike, so a token's result never depends on how its
prompt was split into chunks, on a prefix hit or on its batch (docs/architecture.md,
"Latent attention and DeepSeek models"). `expanded_attention` is transformers' form, kept
as the reference the absorbed one is tested against.

Rope: DeepSeek stores the rope dims of q and k_rot in interleaved pairs; the loader permutes
those rows to halves (model/hf_weights.py), after which the usual rotate-half RoPE gives the
same scores.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import latent_paged_attention
from model.batch import Batch
from model.config import ModelConfig
from model.kv_cache import KVCache, write_latent
from model.layers import Linear, RMSNorm, init, matmul, reduce_shards
from model.rope import apply_rope, rope_attention_factor, rope_inv_freq

# transformers builds q_a_layernorm and kv_a_layernorm without an eps: its default.
LATENT_NORM_EPS = 1e-6


def per_head_matmul(x, w):
    """x [T, H, a] times each head's own weight -> [T, H, b]. w: [H, a, b], or (prepared for
    the CPU kernels, model/runtime_params.py) a sequence of H {"kernel": [a, b]}, each through
    the dense kernel whose rows do not depend on their batch."""
    if isinstance(w, (list, tuple)):
        return jnp.stack([matmul(x[:, h], w[h]["kernel"]) for h in range(len(w))], axis=1)
    return jnp.einsum("tha,hab->thb", x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


class LatentAttention(nn.Module):
    cfg: ModelConfig
    backend: str
    axis: str | None = None  # tensor parallel: the mesh axis o_proj's partial sums meet on

    def _stored(self, name: str, shape: tuple):
        """A weight used as stored or as prepared (no shape check against `shape`)."""
        if self.is_initializing():
            return self.param(name, init, shape, self.cfg.dtype)
        return self.get_variable("params", name)

    @nn.compact
    def __call__(self, x, cache: KVCache, layer, window, batch: Batch, kv_layer):
        cfg = self.cfg
        T, H, r = x.shape[0], cfg.num_heads, cfg.kv_lora_rank
        nope, rot = cfg.qk_nope_head_dim, cfg.head_dim
        q_nope, q_rot = self._queries(x)
        kv = Linear(r + rot, cfg.qkv_bias, cfg.dtype, name="kv_a_proj")(x)
        c = RMSNorm(LATENT_NORM_EPS, cfg.dtype, name="kv_a_norm")(kv[:, :r])
        inv_freq, factor = rope_inv_freq(cfg, layer), rope_attention_factor(cfg, layer)
        q_rot = apply_rope(q_rot, batch.positions, inv_freq, factor)
        k_rot = apply_rope(kv[:, None, r:], batch.positions, inv_freq, factor)
        latent = jnp.concatenate([c[:, None, :], k_rot], axis=-1)  # [T, 1, r + rot]
        cache = write_latent(cache, kv_layer, latent, batch.slot_mapping)
        k_up = self._stored("k_up", (H, nope, r))
        v_up = self._stored("v_up", (H, r, cfg.v_head_dim))
        q = jnp.concatenate([per_head_matmul(q_nope, k_up), q_rot], axis=-1)
        out = latent_paged_attention(q, cache, kv_layer, batch, cfg.attn_scale, self.backend,
                                     value_dim=r)  # [T, H, r]
        out = per_head_matmul(out, v_up).reshape(T, H * cfg.v_head_dim)
        out = Linear(cfg.hidden_size, cfg.o_bias, cfg.dtype, name="o_proj")(out)
        return reduce_shards(out, self.axis), cache

    def _queries(self, x):
        """-> (q_nope [T, H, nope], q_rot [T, H, rot]), through the low-rank q_a / q_b pair
        or one q_proj (q_lora_rank 0)."""
        cfg = self.cfg
        width = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.head_dim)
        if cfg.q_lora_rank:
            q = Linear(cfg.q_lora_rank, cfg.qkv_bias, cfg.dtype, name="q_a_proj")(x)
            q = RMSNorm(LATENT_NORM_EPS, cfg.dtype, name="q_a_norm")(q)
            q = Linear(width, False, cfg.dtype, name="q_b_proj")(q)
        else:
            q = Linear(width, False, cfg.dtype, name="q_proj")(x)
        q = q.reshape(x.shape[0], cfg.num_heads, -1)
        return q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]


def expanded_attention(q_nope, q_rot, latents, k_up, v_up, scale: float):
    """transformers' form for one sequence: every latent expanded into per-head keys and
    values, causal attention in float32. q_nope [T, H, nope], q_rot [T, H, rot] (rotated),
    latents [S, r + rot] (the cache's rows for positions 0..S-1, the T queries at the
    last T positions), k_up [H, nope, r], v_up [H, r, v] -> [T, H, v]."""
    r = k_up.shape[-1]
    hi = jax.lax.Precision.HIGHEST
    c, k_rot = latents[:, :r].astype(jnp.float32), latents[:, r:].astype(jnp.float32)
    k_nope = jnp.einsum("sr,hnr->shn", c, k_up.astype(jnp.float32), precision=hi)
    v = jnp.einsum("sr,hrv->shv", c, v_up.astype(jnp.float32), precision=hi)
    scores = (jnp.einsum("thn,shn->hts", q_nope.astype(jnp.float32), k_nope, precision=hi)
              + jnp.einsum("thd,sd->hts", q_rot.astype(jnp.float32), k_rot, precision=hi))
    T, S = q_nope.shape[0], latents.shape[0]
    visible = jnp.arange(S)[None, :] <= (S - T + jnp.arange(T))[:, None]
    probs = jax.nn.softmax(jnp.where(visible[None], scores * scale, -jnp.inf), axis=-1)
    return jnp.einsum("hts,shv->thv", probs, v, precision=hi)
