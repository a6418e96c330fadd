"""The decoder-only transformer of the Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3
families and their mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss,
GLM-4.5, and DeepSeek-V2/V3 with latent attention: model/latent_attention.py), in Flax.

`forward(params, cache, batch, cfg)` is a pure function: it returns the logits of the tokens
named by `batch.logits_indices` and the cache with this step's keys and values written in.
"""
from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import lora
from model.attention import paged_attention
from model.batch import Batch
from model.config import ModelConfig
from model.kv_cache import KVCache, write_kv
from model.kv_groups import kv_layers, layer_windows, state_layers
from model.latent_attention import LatentAttention
from model.linear_attention.gated_deltanet import GatedDeltaNet
from model.linear_attention.mamba2 import Mamba2
from model.linear_attention.state import RecurrentState
from model.moe import MoE
from model.runtime_params import prepare_params
from model.sharding import embed_vocab_parallel
from model.layers import (MLP, Linear, embed, matmul, matmul_t, norm, reduce_shards,
                          scaled, soft_cap)
from model.rounding import rounded
from model.rope import apply_rope, rope_attention_factor, rope_inv_freq


class Attention(nn.Module):
    cfg: ModelConfig
    backend: str
    axis: str | None = None  # tensor parallel: the mesh axis o_proj's partial sums meet on

    @nn.compact
    def __call__(self, x, cache: KVCache, layer, window, batch: Batch, kv_layer):
        """layer: the model's layer; kv_layer: its index in `cache` (model/kv_groups.py)."""
        cfg = self.cfg
        T = x.shape[0]
        # gated attention: q_proj gives each head's query, then its output gate
        sizes = (cfg.q_size * (2 if cfg.attn_output_gate else 1), cfg.kv_size, cfg.kv_size)
        if self.has_variable("params", "qkv_proj"):  # joined by prepare_params
            qkv = Linear(sum(sizes), cfg.qkv_bias, cfg.dtype, name="qkv_proj")(x)
            q, k, v = jnp.split(qkv, (sizes[0], sizes[0] + sizes[1]), axis=-1)
        else:
            q, k, v = (Linear(n, cfg.qkv_bias, cfg.dtype, name=f"{p}_proj")(x)
                       for n, p in zip(sizes, "qkv"))
        if cfg.qk_norm_full:  # OLMoE: over every head at once, before the reshape
            q, k = norm(cfg, "q_norm")(q), norm(cfg, "k_norm")(k)
        gate = None
        if cfg.attn_output_gate:
            q, gate = jnp.split(q.reshape(T, cfg.num_heads, 2 * cfg.head_dim), 2, axis=-1)
            gate = gate.reshape(T, cfg.q_size)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)
        k = scaled(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), cfg, "key")  # Falcon-H1
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = norm(cfg, "q_norm")(q), norm(cfg, "k_norm")(k)
        if cfg.clip_qkv:
            q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
        if cfg.use_rope:
            inv_freq, factor = rope_inv_freq(cfg, layer), rope_attention_factor(cfg, layer)
            q = apply_rope(q, batch.positions, inv_freq, factor)
            k = apply_rope(k, batch.positions, inv_freq, factor)
        cache = write_kv(cache, kv_layer, k, v, batch.slot_mapping)
        sinks = None
        if cfg.attn_sinks:  # gpt-oss: one learned logit per query head
            sinks = self.param("sinks", nn.initializers.normal(0.02), (cfg.num_heads,),
                               cfg.dtype).astype(jnp.float32)
        out = paged_attention(q, cache, kv_layer, batch, window, cfg.attn_scale, self.backend,
                              sinks=sinks, soft_cap=cfg.attn_soft_cap)
        out = out.reshape(T, cfg.q_size)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        out = Linear(cfg.hidden_size, cfg.o_bias, cfg.dtype, name="o_proj")(out)
        return reduce_shards(out, self.axis), cache


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    backend: str
    axis: str | None = None

    @nn.compact
    def __call__(self, x, cache: KVCache, layer: int, window, batch: Batch,
                 kv_layer: int | None = None):
        cfg = self.cfg
        h = norm(cfg, "input_norm")(x)
        kv_layer = layer if kv_layer is None else kv_layer
        mixer = cfg.mixer(layer)
        # A linear mixer's `cache` is the linear layers' RecurrentState.
        if mixer == "gdn":
            h, cache = GatedDeltaNet(cfg, name="linear_attn")(h, cache, kv_layer, batch)
        elif mixer == "mamba2":
            h, cache = Mamba2(cfg, name="mamba")(h, cache, kv_layer, batch)
        elif mixer == "none":  # a block of an MLP or experts alone (Nemotron-H)
            h = self._mlp(h, layer)
        elif mixer == "hybrid":  # Falcon-H1: Mamba2 and attention side by side
            h, cache = self._side_by_side(h, cache, layer, window, batch, kv_layer)
        else:
            kind = LatentAttention if cfg.latent else Attention
            attn = kind(cfg, self.backend, self.axis, name="attn")
            h, cache = attn(h, cache, layer, window, batch, kv_layer)
        if cfg.blocks:  # one block a layer: its output joins the residual, no MLP follows
            return x + h, cache
        if cfg.residual_multiplier != 1.0:  # Granite: each block's output scaled first
            return self._scaled(x, h, layer), cache
        if cfg.sandwich_norms:
            # Gemma: config.json's post_attention_layernorm norms the attention's output, a
            # pre_feedforward norm feeds the MLP and a post_feedforward norm its output.
            x = x + norm(cfg, "post_norm")(h)
            h = MLP(cfg, self.axis, name="mlp")(norm(cfg, "pre_mlp_norm")(x))
            return x + norm(cfg, "post_mlp_norm")(h), cache
        x = x + h
        h = norm(cfg, "post_norm")(x)
        return x + self._mlp(h, layer), cache

    def _mlp(self, h, layer: int):
        cfg = self.cfg
        if cfg.is_moe(layer):
            return MoE(cfg, self.axis, name="moe")(h)
        return MLP(cfg, self.axis, name="mlp")(h)

    def _side_by_side(self, h, caches, layer: int, window, batch, indices):
        """Mamba2 and attention on the same normed input, each scaled in and out by its
        multipliers, their outputs added; caches and indices: (K/V, state) each."""
        cfg = self.cfg
        (cache, state), (kv_layer, state_layer) = caches, indices
        m, state = Mamba2(cfg, name="mamba")(scaled(h, cfg, "ssm_in"), state, state_layer,
                                             batch)
        a, cache = Attention(cfg, self.backend, self.axis, name="attn")(
            scaled(h, cfg, "attn_in"), cache, layer, window, batch, kv_layer)
        return scaled(m, cfg, "ssm_out") + scaled(a, cfg, "attn_out"), (cache, state)

    def _scaled(self, x, h, layer: int):
        """x + m * mixer(x) then + m * MLP, m the residual multiplier (Granite), each
        product rounded before its add (`rounded`)."""
        m = jnp.asarray(self.cfg.residual_multiplier, self.cfg.dtype)
        x = x + rounded(h * m)
        return x + rounded(self._mlp(norm(self.cfg, "post_norm")(x), layer) * m)


def forward(params, cache: KVCache, batch: Batch, cfg: ModelConfig, backend: str = "reference",
            lora_slots=None):
    """-> (logits float32[R, V], new cache) for the tokens named by `batch.logits_indices`.

    Pure: jit it with the cache donated. params: stored or, to run fast, prepared once with
    `model.runtime_params.prepare_params`. lora_slots: adapters' weights (model/lora.py),
    with `batch.lora_slots` saying which each token uses."""
    params = prepare_params(params)
    hidden, cache = forward_hidden(params, cache, batch, cfg, backend, lora_slots=lora_slots)
    return compute_logits(params, hidden[batch.logits_indices], cfg), cache


def forward_hidden(params, cache: KVCache, batch: Batch, cfg: ModelConfig,
                   backend: str = "reference", axis: str | None = None, lora_slots=None):
    """-> (hidden [T, hidden_size] before the final norm, new cache): every token's last
    residual stream, for callers that need more than one row's logits (prompt logprobs).
    The layers are unrolled, each reading its own weights and its slice of the cache at a
    static layer index.

    axis: inside shard_map, the tensor-parallel mesh axis; params, cache and cfg are then
    this shard's (model/sharding.py) and the hidden states come out whole on every shard.
    lora_slots: adapters' weights per layer (model/lora.py), or None."""
    params = prepare_params(params)
    if axis is None:
        x = embed(params["embed"], batch.input_ids, cfg.dtype)
    else:
        x = embed_vocab_parallel(params["embed"], batch.input_ids, cfg.dtype, axis)
    if cfg.scale_embed:  # Gemma: the scale rounded to the dtype first, as transformers does
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, cfg.dtype)
    if cfg.embedding_multiplier != 1.0:  # Granite
        x = rounded(x * jnp.asarray(cfg.embedding_multiplier, cfg.dtype))
    layer = DecoderLayer(cfg, backend, axis)
    windows = layer_windows(cfg)
    routing = None
    if lora_slots is not None:
        routing = lora.route(batch.lora_slots, jax.tree.leaves(lora_slots)[0].shape[0])
    # A hybrid model's window layers read and write their own cache through their own page
    # table (model/kv_groups.py); the others, and every layer of a one-part cache, the main.
    window_cache, cache = cache.window, replace(cache, window=None)
    # A linear-attention hybrid's linear layers keep a recurrent state per request instead
    # (model/linear_attention/state.py), each at its index among them.
    state, cache = cache.state, replace(cache, state=None)
    window_batch = batch.window_view() if window_cache is not None else None
    stateful = state_layers(cfg)
    for i, (in_window, j) in enumerate(kv_layers(cfg, window_cache is not None)):
        variables = {"params": params["layers"][i]}
        if routing is not None:
            variables["lora"] = lora.layer_variables(lora_slots[i], routing)
        w = jnp.int32(windows[i])
        if cfg.mixer(i) == "hybrid":  # K/V pages and a state both
            x, (cache, state) = layer.apply(variables, x, (cache, state), i, w, batch,
                                            (j, stateful[i]))
        elif cfg.mixer(i) != "attention":
            x, state = layer.apply(variables, x, state, i, w, batch, j)
        elif in_window:
            x, window_cache = layer.apply(variables, x, window_cache, i, w, window_batch, j)
        else:
            x, cache = layer.apply(variables, x, cache, i, w, batch, j)
    return x, replace(cache, window=window_cache, state=state)


def final_norm(params, hidden, cfg: ModelConfig):
    """hidden: [N, hidden_size] from forward_hidden -> what the head multiplies."""
    return norm(cfg).apply({"params": params["final_norm"]}, hidden)


def compute_logits(params, hidden, cfg: ModelConfig, axis: str | None = None):
    """hidden: [N, hidden_size] from forward_hidden -> logits float32[N, V]. axis: the
    tensor-parallel mesh axis: each shard's vocabulary rows, gathered."""
    params = prepare_params(params)
    x = final_norm(params, hidden, cfg)
    if "lm_head" not in params:  # tied, and not packed apart by prepare_params
        logits = matmul_t(x, params["embed"])
    else:
        logits = matmul(x, params["lm_head"]["kernel"])
    if axis is not None:
        logits = jax.lax.all_gather(logits, axis, axis=1, tiled=True)[:, :cfg.vocab_size]
    if cfg.logits_scaling != 1.0:  # Granite
        logits = logits / jnp.asarray(cfg.logits_scaling, logits.dtype)
    logits = scaled(logits, cfg, "lm_head")  # Falcon-H1
    return soft_cap(logits, cfg.final_soft_cap).astype(jnp.float32)


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random weights in the model's dtype (for tests and dummy weights): layers stacked, or
    a list of per-layer trees where layers differ (dense and MoE mixed)."""
    return jax.jit(lambda key: _init(cfg, key))(jax.random.PRNGKey(seed))


def abstract_params(cfg: ModelConfig):
    """The parameter tree as ShapeDtypeStructs: the single declaration of every weight.
    Where dense and MoE layers mix, one layer of each kind is traced and its shapes stand
    for every layer of that kind (tracing DeepSeek-V3's 61 layers one by one takes most of a
    minute; their shapes differ only by kind)."""
    key = jax.random.PRNGKey(0)
    if cfg.uniform_layers:
        return jax.eval_shape(lambda: _init(cfg, key))
    kinds = sorted(set(cfg.layer_kinds))
    first = [cfg.layer_kinds.index(kind) for kind in kinds]  # a layer of each kind
    some = replace(cfg, num_layers=len(kinds),
                   moe_layers=tuple(moe for _, moe in kinds) if cfg.moe_layers else (),
                   mixers=tuple(mixer for mixer, _ in kinds) if cfg.mixers else (),
                   sliding_windows=tuple(cfg.window(i) for i in first) if cfg.sliding_windows
                   else ())
    params = jax.eval_shape(lambda: _init(some, key))
    return {**params, "layers": [params["layers"][kinds.index(kind)]
                                 for kind in cfg.layer_kinds]}


def _init(cfg: ModelConfig, key):
    cfg = replace(cfg, expert_shards=1)  # a stored tree holds every expert
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    batch = Batch(*(jnp.zeros((1,), jnp.int32) for _ in range(4)),
                  jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
                  state_slots=jnp.zeros((1,), jnp.int32),
                  query_start=jnp.array([0, 1], jnp.int32))
    cache = KVCache.zeros(cfg, 1, 1)
    state = RecurrentState.zeros(cfg, 1) if cfg.num_linear_layers else None
    x = jnp.zeros((1, cfg.hidden_size), cfg.dtype)
    caches = {"attention": cache, "hybrid": (cache, state)}
    init_layer = lambda k, i: DecoderLayer(cfg, "reference").init(
        k, x, caches.get(cfg.mixer(i), state), i, jnp.int32(0), batch,
        (0, 0) if cfg.mixer(i) == "hybrid" else 0)["params"]
    keys = jax.random.split(k_layers, cfg.num_layers)
    if cfg.uniform_layers:
        layers = jax.vmap(lambda k: init_layer(k, 0))(keys)
    else:
        layers = [init_layer(k, i) for i, k in enumerate(keys)]
    params = {
        "embed": nn.initializers.normal(0.02)(k_embed, (cfg.vocab_size, cfg.hidden_size),
                                              cfg.dtype),
        "layers": layers,
        "final_norm": {"scale": (jnp.zeros if cfg.norm_offset else jnp.ones)(
            (cfg.hidden_size,), cfg.dtype)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": nn.initializers.normal(0.02)(
            k_head, (cfg.hidden_size, cfg.vocab_size), cfg.dtype)}
    return params
