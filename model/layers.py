"""Building blocks shared by every family: linear, RMSNorm, activations, soft-cap, gated MLP."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import lora
from model.config import ModelConfig
from model.rounding import rounded
from pallas_kernels import rms_norm_cpu
from quant import ops as quant_ops

init = nn.initializers.normal(0.02)


def matmul(x, w):
    """x: [..., in] @ w: [in, out] in x's dtype. The one place weights meet activations;
    w may be a QuantArray (int8 / fp8), see quant/ops.py."""
    return quant_ops.matmul(x, w)


def matmul_t(x, table):
    """x: [..., hidden] against every row of table [vocab, hidden]: the tied head."""
    return quant_ops.matmul_t(x, table)


def embed(table, ids, dtype):
    """Rows `ids` of the embedding table (plain or a QuantArray) in `dtype`."""
    return quant_ops.take(table, ids, dtype)


class Linear(nn.Module):
    features: int
    use_bias: bool = False
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", init, (x.shape[-1], self.features), self.param_dtype)
        y = matmul(x, w)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,),
                               self.param_dtype).astype(y.dtype)
        if self.has_variable("lora", "a"):  # adapters' updates (model/lora.py)
            y = y + lora.delta(x, self.variables["lora"])
        return y


class RMSNorm(nn.Module):
    eps: float
    param_dtype: str = "float32"
    # Gemma: the stored weight w scales by (1 + w), in float32 before the cast (a zero
    # weight is the identity).
    offset: bool = False
    weight_f32: bool = False  # w times the normed row in float32, then the cast (Nemotron-H)

    @nn.compact
    def __call__(self, x):
        init_scale = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init_scale, (x.shape[-1],), self.param_dtype)
        # Normalise in float32, then scale in the activation dtype, as transformers does. On
        # CPUs each row is summed in one order whatever the batch (pallas_kernels/rms_norm_cpu).
        x32 = rms_norm_cpu.normalize(x.astype(jnp.float32), self.eps)
        if self.offset:
            return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        if self.weight_f32:
            return (scale.astype(jnp.float32) * x32).astype(x.dtype)
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def norm(cfg: ModelConfig, name: str | None = None) -> RMSNorm:
    """The family's RMSNorm."""
    return RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.norm_offset, cfg.norm_weight_f32,
                   name=name)


def activation(name: str):
    """ModelConfig.hidden_act -> the function the MLP's gate goes through."""
    if name == "gelu_tanh":
        return lambda x: nn.gelu(x, approximate=True)
    if name == "relu2":  # squared ReLU (Nemotron-H)
        return lambda x: jnp.square(nn.relu(x))
    return nn.silu


def reduce_shards(x, axis: str | None):
    """A row-parallel projection's partial sums, added over the tensor-parallel axis (the
    one all-reduce of o_proj and of down_proj); None: one device, nothing to add."""
    return x if axis is None else jax.lax.psum(x, axis)


class MLP(nn.Module):
    cfg: ModelConfig
    axis: str | None = None  # tensor parallel: the mesh axis down_proj's partial sums meet on
    intermediate_size: int = 0  # 0: the config's (a shared expert has a size of its own)

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        lin = lambda n, name: Linear(n, cfg.mlp_bias, cfg.dtype, name=name)
        n = self.intermediate_size or cfg.intermediate_size
        act = activation(cfg.hidden_act)
        if not cfg.mlp_gated:  # act(up), no gate
            return reduce_shards(lin(cfg.hidden_size, "down_proj")(act(lin(n, "up_proj")(x))),
                                 self.axis)
        if self.has_variable("params", "gate_up_proj"):  # joined by prepare_params
            gate, up = jnp.split(lin(2 * n, "gate_up_proj")(x), 2, axis=-1)
        else:
            gate, up = lin(n, "gate_proj")(x), lin(n, "up_proj")(x)
        # Falcon-H1's multipliers on the gate and the output (1 elsewhere: nothing)
        down = lin(cfg.hidden_size, "down_proj")(act(scaled(gate, cfg, "mlp_gate")) * up)
        return reduce_shards(scaled(down, cfg, "mlp_down"), self.axis)


def scaled(x, cfg: ModelConfig, name: str):
    """x times the multiplier `name` (ModelConfig.multipliers) in x's dtype, rounded; x
    itself where that is 1."""
    m = cfg.mult(name)
    return x if m == 1.0 else rounded(x * jnp.asarray(m, x.dtype))


def soft_cap(x, cap: float):
    """cap * tanh(x / cap) (Gemma 2's final logits); cap 0: x. In x's dtype, as
    transformers caps the head's output."""
    return cap * jnp.tanh(x / cap) if cap else x
