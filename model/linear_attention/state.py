"""The recurrent state of a model's linear-attention layers: one slot per running request.

Each slot holds, for every linear layer, the short convolution's last K-1 inputs (in the
model's dtype) and the delta rule's state, [value heads, key dim, value dim] (float32 by
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
from model.linear_config import conv_channels


@jax.tree_util.register_dataclass
@dataclass
class RecurrentState:
    conv: jax.Array  # [L, S, K - 1, C] the conv's last K - 1 inputs, oldest first
    ssm: jax.Array  # [L, S, H, dk, dv] the delta rule's state per value head

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @staticmethod
    def shapes(cfg: ModelConfig, num_slots: int) -> tuple[tuple, tuple]:
        layers = cfg.num_linear_layers
        return ((layers, num_slots, cfg.linear_conv_kernel - 1, conv_channels(cfg)),
                (layers, num_slots, cfg.linear_value_heads, cfg.linear_key_dim,
                 cfg.linear_value_dim))

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
