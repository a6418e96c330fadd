"""Prompt logprobs: the logprob of each prompt token given its prefix, and its top-k
alternatives, computed in the prefill steps that run the prompt (chunked prefill included).

Device: the step keeps every token's last hidden state; when some row of the step asks
(`any_prompt_logprobs`), a `lax.cond` branch of the same program runs the final norm and the
LM head over all T rows, block by block, and returns each row's logprob of its target token
(the next prompt token), its rank and the top-k. Steps where no row asks take the other branch
and return zeros of the same fixed shapes, so there is no extra program and no extra per-token
work for them (docs/benchmarks.md has the cost of both).

The host side (which positions score which token, a request's entries across its chunks)
is serving.core.prompt_logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.transformer import compute_logits
from serving.engine.sampler import top_logprobs

BLOCK_ROWS = 128  # rows of [rows, V] logits alive at once: 25 MiB of float32 for a 49k vocab


@jax.tree_util.register_dataclass
@dataclass
class PromptInputs:
    targets: jax.Array  # i32[T] the next prompt token of each position that asks, -1 elsewhere
    any_prompt_logprobs: jax.Array  # bool[]


@jax.tree_util.register_dataclass
@dataclass
class PromptOutput:
    logprob: jax.Array  # f32[T] of the target token
    rank: jax.Array  # i32[T] 1 + how many tokens are more likely than the target
    top_ids: jax.Array  # i32[T, K]
    top_logprobs: jax.Array  # f32[T, K]


def _block_rows(T: int) -> int:
    """The largest divisor of T not above BLOCK_ROWS (token buckets are powers of two)."""
    return next(b for b in range(min(T, BLOCK_ROWS), 0, -1) if T % b == 0)


def prompt_logprobs(params, hidden, p: PromptInputs, cfg: ModelConfig,
                    num_top: int) -> PromptOutput:
    """hidden: [T, hidden_size] from model.transformer.forward_hidden -> PromptOutput."""
    T, H = hidden.shape
    K = max(num_top, 1)
    B = _block_rows(T)

    def block(args):
        h, targets = args  # [B, H], i32[B]
        logprobs, ids, vals = top_logprobs(compute_logits(params, h, cfg), K)
        lp = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], 1)[:, 0]
        rank = 1 + jnp.sum(logprobs > lp[:, None], axis=-1, dtype=jnp.int32)
        return PromptOutput(lp, rank, ids, vals)

    def compute(hidden):
        out = jax.lax.map(block, (hidden.reshape(T // B, B, H), p.targets.reshape(T // B, B)))
        return jax.tree.map(lambda a: a.reshape(T, *a.shape[2:]), out)

    def skip(hidden):
        return PromptOutput(jnp.zeros((T,), jnp.float32), jnp.zeros((T,), jnp.int32),
                            jnp.zeros((T, K), jnp.int32), jnp.zeros((T, K), jnp.float32))

    return jax.lax.cond(p.any_prompt_logprobs, compute, skip, hidden)
