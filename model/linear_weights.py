"""Gated DeltaNet tensors as our mixer takes them (model/linear_attention/gated_deltanet.py):
names onto parameter paths, the conv's [C, 1, K] weight as [K, C], and Qwen3-Next's fused
projections, grouped per key head, reordered into Qwen3.5's flat layout (every head's q,
then k, then v; z, b and a apart). Data for model/hf_weights.py."""
from __future__ import annotations

import re

import numpy as np

from model.config import ModelConfig

_LAYER = r"model\.layers\.(\d+)\."
_MIXER = ("layers", "linear_attn")
# (HF name pattern, parameter path, transpose), as hf_weights.HF_TABLE
TABLE = [
    (_LAYER + r"linear_attn\.in_proj_(qkv|z|b|a)\.weight", (*_MIXER, "in_proj_{}", "kernel"),
     True),
    (_LAYER + r"linear_attn\.out_proj\.weight", (*_MIXER, "out_proj", "kernel"), True),
    (_LAYER + r"linear_attn\.dt_bias", (*_MIXER, "dt_bias"), False),
    (_LAYER + r"linear_attn\.A_log", (*_MIXER, "A_log"), False),
    (_LAYER + r"linear_attn\.norm\.weight", (*_MIXER, "norm_weight"), False),
]
_CONV = re.compile(_LAYER + r"linear_attn\.conv1d\.weight")
_QKVZ = re.compile(_LAYER + r"linear_attn\.in_proj_qkvz\.weight")
_BA = re.compile(_LAYER + r"linear_attn\.in_proj_ba\.weight")


def split(name: str, read, cfg: ModelConfig):
    """-> (layer, [(path, array, transpose)]) for the tensors that are not one parameter
    as stored, or None for another tensor. read: name -> the tensor."""
    for pattern, parts in ((_CONV, _conv), (_QKVZ, _qkvz), (_BA, _ba)):
        m = pattern.fullmatch(name)
        if m:
            return int(m.group(1)), parts(np.asarray(read(name)), cfg)
    return None


def _conv(w, cfg: ModelConfig):
    """[C, 1, K] (a depthwise Conv1d) -> [K, C], row K - 1 the current token's tap."""
    return [((*_MIXER, "conv_weight"), w.reshape(w.shape[0], w.shape[-1]).T, False)]


def _per_key_head(w, cfg: ModelConfig, widths: list[int]) -> list:
    """Rows grouped per key head as [part 0 | part 1 | ...] -> each part's rows of every
    head, in head order."""
    hk = cfg.linear_key_heads
    if w.shape[0] != hk * sum(widths):
        raise ValueError(f"{w.shape[0]} rows, expected {hk * sum(widths)}")
    grouped = w.reshape(hk, sum(widths), w.shape[-1])
    cuts = np.cumsum(widths)[:-1]
    return [p.reshape(-1, w.shape[-1]) for p in np.split(grouped, cuts, axis=1)]


def _qkvz(w, cfg: ModelConfig):
    dk, r = cfg.linear_key_dim, cfg.linear_value_heads // cfg.linear_key_heads
    vz = r * cfg.linear_value_dim
    q, k, v, z = _per_key_head(w, cfg, [dk, dk, vz, vz])
    return [((*_MIXER, "in_proj_qkv", "kernel"), np.concatenate([q, k, v]).T, True),
            ((*_MIXER, "in_proj_z", "kernel"), z.T, True)]


def _ba(w, cfg: ModelConfig):
    r = cfg.linear_value_heads // cfg.linear_key_heads
    b, a = _per_key_head(w, cfg, [r, r])
    return [((*_MIXER, "in_proj_b", "kernel"), b.T, True),
            ((*_MIXER, "in_proj_a", "kernel"), a.T, True)]
