"""Building blocks shared by every family: linear, RMSNorm, rotary embedding, gated MLP."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import lora
from model.config import ModelConfig
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

    @nn.compact
    def __call__(self, x):
        init_scale = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init_scale, (x.shape[-1],), self.param_dtype)
        # Normalise in float32, then scale in the activation dtype, as transformers does. On
        # CPUs each row is summed in one order whatever the batch (pallas_kernels/rms_norm_cpu).
        x32 = rms_norm_cpu.normalize(x.astype(jnp.float32), self.eps)
        if self.offset:
            return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def norm(cfg: ModelConfig, name: str | None = None) -> RMSNorm:
    """The family's RMSNorm."""
    return RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.norm_offset, name=name)


def activation(name: str):
    """ModelConfig.hidden_act -> the function the MLP's gate goes through."""
    if name == "gelu_tanh":
        return lambda x: nn.gelu(x, approximate=True)
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
        if self.has_variable("params", "gate_up_proj"):  # joined by prepare_params
            gate, up = jnp.split(lin(2 * n, "gate_up_proj")(x), 2, axis=-1)
        else:
            gate, up = lin(n, "gate_proj")(x), lin(n, "up_proj")(x)
        act = activation(cfg.hidden_act)
        return reduce_shards(lin(cfg.hidden_size, "down_proj")(act(gate) * up), self.axis)


def soft_cap(x, cap: float):
    """cap * tanh(x / cap) (Gemma 2's final logits); cap 0: x. In x's dtype, as
    transformers caps the head's output."""
    return cap * jnp.tanh(x / cap) if cap else x


def rope_inv_freq(cfg: ModelConfig, layer: int = 0) -> np.ndarray:
    """float32[D/2] inverse frequencies of `layer`, with Llama 3 / linear scaling applied
    (Gemma 3's window layers have a base of their own and no scaling)."""
    dim = cfg.head_dim
    local = cfg.local_rope_theta and cfg.window(layer)
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    rs = {} if local else cfg.rope_scaling_dict
    if rs.get("rope_type") == "linear":
        inv = inv / rs["factor"]
    elif rs.get("rope_type") == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def _rotate(x, cos, rotated, sin):
    return x * cos + rotated * sin


def _rotate_unfused(x, cos, rotated, sin):
    """The two products kept apart from their sum: XLA:CPU contracts `a * b + c * d` into an
    FMA in some fusions and not in others, and which one it builds depended on the step's
    token count, so a key's last bits changed with the batch (docs/architecture.md, "Batch
    invariance")."""
    a, b = jax.lax.optimization_barrier((x * cos, rotated * sin))
    return a + b


def apply_rope(x, positions, inv_freq):
    """x: [T, N, D] rotated by position (the rotate-half layout of transformers). On CPUs
    without the FMA contraction XLA chooses per fusion; elsewhere as XLA fuses it."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, None, :].astype(x.dtype), jnp.sin(emb)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return jax.lax.platform_dependent(x, cos, rotated, sin, cpu=_rotate_unfused,
                                      default=_rotate)
