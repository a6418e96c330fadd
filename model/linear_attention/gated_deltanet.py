"""The Gated DeltaNet mixer (Qwen3-Next, Qwen3.5) as one layer of the decoder.

Per token, as transformers computes it: project to q, k, v (one short causal convolution over
their channels, then SiLU), z (the output gate), b and a (the write and decay gates); q and
k L2-normalised per head in float32, q scaled by dk^-1/2; beta = sigmoid(b) and
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule over each value head's state
(model/linear_attention/delta_rule.py); each head's output RMS-normed, times the norm's
weight, times SiLU(z); out_proj.

Each value head j reads key head j // (value heads / key heads). The stored weights use one
layout for both families: in_proj_qkv's outputs are every head's q, then every head's k,
then every head's v (Qwen3.5's layout; Qwen3-Next's per-key-head groups are reordered at
load, model/linear_weights.py), and conv_weight is [K, channels] with row K - 1 the current
token's tap.

A request's state lives in a slot of the RecurrentState (model/linear_attention/state.py),
named per row by `batch.state_slots`; a row whose first token this step is at position 0
starts from zeros, whatever its slot holds.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.batch import Batch
from model.config import ModelConfig
from model.layers import Linear, init
from model.linear_attention.delta_rule import gated_delta_rule
from model.linear_attention.short_conv import causal_conv
from model.linear_attention.state import RecurrentState, read_rows, write_rows
from model.linear_config import conv_channels
from model.rounding import rounded
from pallas_kernels import rms_norm_cpu

L2_EPS = 1e-6
# The delta rule's form (model/linear_attention/delta_rule.py): token-serial, whose loop
# body has one shape whatever the step's bucket, so a row's numbers depend only on its own
# tokens (batch invariance); or chunked.
CHUNKED = False


def l2_normalize(x32, eps: float = L2_EPS):
    """x / sqrt(sum(x^2) + eps) over the last axis, each row summed in one fixed order on
    CPUs (pallas_kernels/rms_norm_cpu.py): the RMS norm with eps / D, scaled by D^-1/2."""
    d = x32.shape[-1]
    return rms_norm_cpu.normalize(x32, eps / d) * jnp.float32(d ** -0.5)


class GatedDeltaNet(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, state: RecurrentState, layer, batch: Batch):
        """x: [T, hidden] -> ([T, hidden], state with this step's rows written back);
        layer: this layer's index among the linear layers."""
        cfg = self.cfg
        T, dtype = x.shape[0], cfg.dtype
        hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
        dk, dv = cfg.linear_key_dim, cfg.linear_value_dim
        key_dim, value_dim = hk * dk, hv * dv
        sizes = (2 * key_dim + value_dim, value_dim, hv, hv)
        if self.has_variable("params", "in_proj"):  # joined by prepare_params
            mixed = Linear(sum(sizes), False, dtype, name="in_proj")(x)
            qkv, z, b, a = jnp.split(mixed, (sizes[0], sizes[0] + sizes[1],
                                             sizes[0] + sizes[1] + hv), axis=-1)
        else:
            qkv, z, b, a = (Linear(n, False, dtype, name=f"in_proj_{p}")(x)
                            for n, p in zip(sizes, ("qkv", "z", "b", "a")))
        conv_w = self.param("conv_weight", init, (cfg.linear_conv_kernel, conv_channels(cfg)),
                            dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), dtype)
        norm_w = self.param("norm_weight", nn.initializers.ones, (dv,), dtype)

        conv0, ssm0 = read_rows(state, layer, batch)

        mixed_qkv, conv1 = causal_conv(qkv, conv_w, None, conv0, batch.query_start,
                                       batch.req_indices)
        q, k, v = jnp.split(mixed_qkv, (key_dim, 2 * key_dim), axis=-1)
        q = l2_normalize(q.reshape(T, hk, dk).astype(jnp.float32)) * jnp.float32(dk ** -0.5)
        k = l2_normalize(k.reshape(T, hk, dk).astype(jnp.float32))
        if hv != hk:  # value head j reads key head j // (hv / hk)
            q, k = (jnp.repeat(t, hv // hk, axis=1) for t in (q, k))
        v = v.reshape(T, hv, dv).astype(jnp.float32)
        beta = jax.nn.sigmoid(b).astype(jnp.float32)  # in the model's dtype, as transformers
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        beta, g = rounded((beta, g))  # not fused into the rule's exp (model/rounding.py)
        core, ssm1 = gated_delta_rule(q, k, v, g, beta, ssm0, batch.query_start,
                                      batch.req_indices, batch.positions, chunked=CHUNKED)
        out = gated_norm(core.astype(dtype), z.reshape(T, hv, dv), norm_w, cfg.rms_norm_eps)
        out = Linear(cfg.hidden_size, False, dtype, name="out_proj")(out.reshape(T, value_dim))
        return out, write_rows(state, layer, batch, conv1, ssm1)


def gated_norm(x, z, weight, eps: float):
    """Each head's output RMS-normed in float32, times the weight in x's dtype, times
    SiLU(z) in float32, back to x's dtype (norm before gate, as transformers)."""
    normed = rms_norm_cpu.normalize(x.astype(jnp.float32), eps).astype(x.dtype)
    gated = (weight.astype(x.dtype) * normed).astype(jnp.float32) * jax.nn.silu(
        z.astype(jnp.float32))
    return gated.astype(x.dtype)
