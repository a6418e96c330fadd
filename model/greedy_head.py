"""Greedy tokens straight from the final hidden states, for steps where every row takes the
argmax and asks for nothing else: the head's CPU kernel keeps each row's largest output as
it computes them (pallas_kernels/cpu/dense_argmax.cc) instead of writing logits for the
sampler to read back. With a small hidden size and a large vocabulary that write is most of
the head (docs/benchmarks.md, "Host work per step").

The token is the one `argmax(compute_logits(...)[:, :vocab_size])` gives, bit for bit the
same logits compared in the same order, so greedy outputs and batch invariance do not move.
Only a head in the dense kernel's panels qualifies, with float32 activations, no final
soft-cap (tanh can make two logits equal that were not) and one device holding the whole
vocabulary; any other head returns None and the sampler takes the argmax of the logits.
"""
from __future__ import annotations

import jax.numpy as jnp

from model.config import ModelConfig
from model.runtime_params import prepare_params
from model.transformer import final_norm
from pallas_kernels.dense_matmul_cpu import argmax_available, dense_argmax
from quant.packed import PackedDense


def greedy_tokens(params, cfg: ModelConfig, vocab_size: int, axis: str | None = None):
    """-> a function hidden [N, hidden_size] -> int32[N], each row's argmax over the first
    `vocab_size` logits, or None where the head has no fused kernel."""
    params = prepare_params(params)
    head = params.get("lm_head", {}).get("kernel")
    if (axis is not None or cfg.final_soft_cap or cfg.logits_scaling != 1.0
            or cfg.mult("lm_head") != 1.0
            or cfg.dtype != "float32"
            or not isinstance(head, PackedDense) or not argmax_available()):
        return None

    def tokens(hidden):
        x = final_norm(params, hidden, cfg)
        if x.dtype != jnp.float32:  # the logits would be rounded first: ties could differ
            raise ValueError(f"the fused greedy head takes float32 rows, got {x.dtype}")
        return dense_argmax(x, head.panels, head.scale, vocab_size)
    return tokens
