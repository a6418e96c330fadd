"""The recurrent state of a model's linear-attention layers: one slot per running request.

Each slot holds, for every linear layer, the short convolution's last K-1 inputs (in the
model's dtype) and the mixer's state: the delta rule's [value heads, key dim, value dim], or
Mamba2's [heads, head dim, state size] (float32 by
default: config.json's mamba_ssm_dtype, or the engine's --mamba-ssm-cache-dtype). Slot 0 is
the null slot: padded rows of a step read and write it, so no real slot is touched by
them. The host hands slots out (serving/core/state_slots.py); a step names each row's slot
in `Batch.state_slots`. docs/architecture.md, "Linear attention and recurrent state".
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.linear_config import conv_channels, ssm_shape


@jax.tree_util.register_dataclass
@dataclass
class RecurrentState:
    conv: jax.Array  # [L, S, K - 1, C] the conv's last K - 1 inputs, oldest first
    ssm: jax.Array  # [L, S, H, d1, d2] each head's state (model/linear_config.py ssm_shape)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @staticmethod
    def shapes(cfg: ModelConfig, num_slots: int) -> tuple[tuple, tuple]:
        layers = cfg.num_linear_layers
        return ((layers, num_slots, cfg.linear_conv_kernel - 1, conv_channels(cfg)),
                (layers, num_slots, *ssm_shape(cfg)))

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_slots: int, ssm_dtype: str | None = None
              ) -> "RecurrentState":
        conv, ssm = cls.shapes(cfg, num_slots)
        return cls(jnp.zeros(conv, cfg.dtype), jnp.zeros(ssm, ssm_dtype or cfg.ssm_state_dtype))


def slot_bytes(cfg: ModelConfig, ssm_dtype: str | None = None) -> int:
    """One request's state over every linear layer."""
    conv, ssm = RecurrentState.shapes(cfg, 1)
    return (int(np.prod(conv)) * jnp.dtype(cfg.dtype).itemsize
            + int(np.prod(ssm)) * jnp.dtype(ssm_dtype or cfg.ssm_state_dtype).itemsize)


def read_rows(state: RecurrentState, layer, batch):
    """Each step row's conv window and float32 state at linear layer `layer`, from its slot;
    zeros for a row whose first token this step is at position 0 (a request starting),
    whatever its slot holds. -> (conv [R, K-1, C], ssm f32[R, H, d1, d2])."""
    T = batch.positions.shape[0]
    first = batch.positions[jnp.minimum(batch.query_start[:-1], T - 1)]
    fresh = first == 0
    slots = batch.state_slots
    conv = jnp.where(fresh[:, None, None], 0, state.conv[layer, slots])
    ssm = jnp.where(fresh[:, None, None, None], 0, state.ssm[layer, slots].astype(jnp.float32))
    return conv, ssm


def write_rows(state: RecurrentState, layer, batch, conv, ssm) -> RecurrentState:
    """The rows' new windows and states written back to their slots at layer `layer`."""
    slots = batch.state_slots
    return RecurrentState(state.conv.at[layer, slots].set(conv.astype(state.conv.dtype)),
                          state.ssm.at[layer, slots].set(ssm.astype(state.ssm.dtype)))
