"""The Mamba2 mixer (Nemotron-H, Granite 4.0-H, Falcon-H1) as one layer of the decoder.

Per token, as transformers computes it: in_proj to z (the output gate), xBC and dt; one
short causal convolution (with its bias) over xBC's channels, then SiLU; xBC split into x
(heads x head_dim), B and C (groups x state_size); dt = softplus(dt + dt_bias) clamped to
the config's limit; A = -exp(A_log); the state-space recurrence with its D skip
(model/linear_attention/ssd.py); y * SiLU(z) RMS-normed per group of channels (gate before
norm) times the norm's weight, or as Falcon-H1 configures it (`gated_group_norm`); out_proj.

The conv weight is stored [K, channels] as model/linear_attention/short_conv.py takes it.
A request's state lives in a slot of the RecurrentState (model/linear_attention/state.py).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.batch import Batch
from model.config import ModelConfig
from model.layers import Linear, init, scaled
from model.linear_attention.short_conv import causal_conv
from model.linear_attention.ssd import ssd_serial
from model.linear_attention.state import RecurrentState, read_rows, write_rows
from model.linear_config import conv_channels
from model.rounding import rounded
from pallas_kernels import rms_norm_cpu


class Mamba2(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, state: RecurrentState, layer, batch: Batch):
        """x: [T, hidden] -> ([T, hidden], state with this step's rows written back);
        layer: this layer's index among the linear layers."""
        cfg = self.cfg
        T, dtype = x.shape[0], cfg.dtype
        H, P, N, G = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state_size, cfg.ssm_groups
        inner, channels = H * P, conv_channels(cfg)
        proj = Linear(inner + channels + H, cfg.ssm_proj_bias, dtype, name="in_proj")(x)
        # Falcon-H1's multiplier on each part (1 elsewhere: nothing)
        z, xs, b, c, dt = (scaled(part, cfg, name) for part, name in zip(
            jnp.split(proj, (inner, 2 * inner, 2 * inner + G * N, 2 * inner + 2 * G * N),
                      axis=-1), ("ssm_z", "ssm_x", "ssm_b", "ssm_c", "ssm_dt")))
        xbc = jnp.concatenate([xs, b, c], axis=-1)
        conv_w = self.param("conv_weight", init, (cfg.linear_conv_kernel, channels), dtype)
        conv_b = (self.param("conv_bias", nn.initializers.zeros, (channels,), dtype)
                  if cfg.ssm_conv_bias else None)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (H,), dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (H,), dtype)
        d = self.param("D", nn.initializers.ones, (H,), dtype)
        norm_w = (self.param("norm_weight", nn.initializers.ones, (inner,), dtype)
                  if cfg.ssm_norm != "none" else None)

        conv0, ssm0 = read_rows(state, layer, batch)
        xbc, conv1 = causal_conv(xbc, conv_w, conv_b, conv0, batch.query_start,
                                 batch.req_indices)
        xs, b, c = jnp.split(xbc, (inner, inner + G * N), axis=-1)
        # dt in the model's dtype, as transformers adds the bias and takes the softplus;
        # rounded here, or XLA:CPU fuses the softplus into the scan's exp differently when
        # a step holds one token (model/rounding.py)
        dt = rounded(jnp.clip(jax.nn.softplus(dt + dt_bias.astype(dt.dtype)), *cfg.ssm_dt_limit))
        a = -jnp.exp(a_log.astype(jnp.float32))
        f32 = lambda t, *shape: t.reshape(T, *shape).astype(jnp.float32)
        y, ssm1 = ssd_serial(f32(xs, H, P), dt.astype(jnp.float32), a, f32(b, G, N),
                             f32(c, G, N), d.astype(jnp.float32), ssm0, batch.query_start,
                             batch.req_indices)
        out = gated_group_norm(y.reshape(T, inner), z, norm_w, G, cfg.rms_norm_eps,
                               cfg.ssm_norm)
        out = Linear(cfg.hidden_size, cfg.ssm_out_bias, dtype, name="out_proj")(
            out.astype(dtype))
        return out, write_rows(state, layer, batch, conv1, ssm1)


def gated_group_norm(y32, z, weight, groups: int, eps: float, order: str = "gate_first"):
    """The output gate and norm in float32 (ModelConfig.ssm_norm): "gate_first", y * SiLU(z)
    RMS-normed over each of `groups` equal runs of channels, times the weight (transformers'
    Mamba2 mixers); "norm_first", the normed y times the weight, times SiLU(z) (Falcon-H1
    with its norm); "none", y * SiLU(z) (Falcon-H1 without)."""
    T, width = y32.shape
    gate = jax.nn.silu(z.astype(jnp.float32))
    if order == "none":
        return y32 * gate
    norm = lambda v: weight.astype(jnp.float32) * rms_norm_cpu.normalize(
        v.reshape(T, groups, width // groups), eps).reshape(T, width)
    return norm(y32 * gate) if order == "gate_first" else norm(y32) * gate
