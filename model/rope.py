"""Rotary position embedding: each layer's inverse frequencies (default, linear, Llama 3 and
YaRN scaling; Gemma 3's window layers with a base of their own) and the rotation itself."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.rounding import rounded


def _local(cfg: ModelConfig, layer: int) -> bool:
    return bool(cfg.local_rope_theta and cfg.window(layer))


def rope_inv_freq(cfg: ModelConfig, layer: int = 0) -> np.ndarray:
    """float32[D/2] inverse frequencies of `layer`, scaled as config.json says (Gemma 3's
    window layers have a base of their own and no scaling). A partial rotary model turns
    only its first `rotary_dim` dims."""
    dim = cfg.rotary_dim or cfg.head_dim
    theta = cfg.local_rope_theta if _local(cfg, layer) else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    rs = {} if _local(cfg, layer) else cfg.rope_scaling_dict
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
    elif rs.get("rope_type") == "yarn":
        inv = _yarn(inv, rs, dim, theta)
    return inv.astype(np.float32)


def _yarn(inv, rs: dict, dim: int, theta: float):
    """YaRN: the fast-rotating dims keep their frequency, the slow ones are divided by the
    factor, and a linear ramp between the dims that turn beta_fast and beta_slow times over
    the original context blends the two."""
    old_len = rs["original_max_position_embeddings"]

    def dim_of(rotations):  # the dim that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(rs.get("beta_fast", 32.0)), dim_of(rs.get("beta_slow", 1.0))
    if rs.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: the frequency as trained
    return (inv / rs["factor"]) * (1 - keep) + inv * keep


def rope_attention_factor(cfg: ModelConfig, layer: int = 0) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (0.1 ln(factor) + 1
    unless config.json gives it), 1 otherwise."""
    rs = {} if _local(cfg, layer) else cfg.rope_scaling_dict
    if rs.get("rope_type") != "yarn":
        return 1.0
    if "attention_factor" in rs:
        return rs["attention_factor"]
    mscale = lambda m: 1.0 if rs["factor"] <= 1 else 0.1 * m * math.log(rs["factor"]) + 1.0
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(rs["mscale"]) / mscale(rs["mscale_all_dim"])
    return mscale(1.0)


def _rotate(x, cos, rotated, sin):
    return x * cos + rotated * sin


def _rotate_unfused(x, cos, rotated, sin):
    """The two products rounded before their sum (model/rounding.py): XLA:CPU contracted
    `a * b + c * d` into an FMA in some step programs and not in others."""
    a, b = rounded((x * cos, rotated * sin))
    return a + b


def apply_rope(x, positions, inv_freq, factor: float = 1.0):
    """x: [T, N, D] rotated by position (the rotate-half layout of transformers), cos and
    sin times `factor` (rope_attention_factor). On CPUs without the FMA contraction XLA
    chooses per fusion; elsewhere as XLA fuses it. With fewer frequencies than half of D
    (a partial rotary model) the first 2 * len(inv_freq) dims turn and the rest pass."""
    turned = 2 * len(inv_freq)
    if turned < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :turned], positions, inv_freq, factor),
                                x[..., turned:]], axis=-1)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return jax.lax.platform_dependent(x, cos, rotated, sin, cpu=_rotate_unfused,
                                      default=_rotate)
