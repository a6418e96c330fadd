"""Prompt logprobs: the logprob of each prompt token given its prefix, its rank and its top-k
alternatives, computed from the prefill steps that run the prompt (chunked prefill included).

Every step program also returns its tokens' last hidden states, cut into blocks of
BLOCK_ROWS rows (the last zero-padded). When some row of the step asks, the runner runs one
more program, `prompt_logprobs`, on each block holding such rows: the final norm, the LM head
and a log_softmax over BLOCK_ROWS rows. That program has one shape whatever the step's
bucket, so it is compiled once at warm-up; steps where no row asks never run it and pay only
for handing the hidden states out (docs/benchmarks.md has both costs).

Why not a `lax.cond` branch inside the step: XLA passes a conditional's operands as a tuple
and copies the weights the branch closes over (the LM head) into it on every step, taken or
not; that costs a decode step of the demo model milliseconds.

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

BLOCK_ROWS = 64  # rows scored at once: [64, V] float32 logits are 12 MiB for a 49k vocab


@jax.tree_util.register_dataclass
@dataclass
class PromptOutput:
    logprob: jax.Array  # f32[N] of the target token
    rank: jax.Array  # i32[N] 1 + how many tokens are more likely than the target
    top_ids: jax.Array  # i32[N, K]
    top_logprobs: jax.Array  # f32[N, K]


def hidden_blocks(hidden) -> tuple[jax.Array, ...]:
    """hidden: [T, H] -> ceil(T / BLOCK_ROWS) arrays [BLOCK_ROWS, H], the last zero-padded."""
    T = hidden.shape[0]
    n = -(-T // BLOCK_ROWS)
    padded = jnp.pad(hidden, ((0, n * BLOCK_ROWS - T), (0, 0)))
    return tuple(padded[i * BLOCK_ROWS:(i + 1) * BLOCK_ROWS] for i in range(n))


def prompt_logprobs(params, hidden, targets, *, cfg: ModelConfig, num_top: int,
                    axis: str | None = None) -> PromptOutput:
    """hidden: [BLOCK_ROWS, H] from hidden_blocks; targets: i32[BLOCK_ROWS] the token each
    row scores (the next prompt token), -1 for rows that score none. axis: tensor parallel
    (one shard's head, logits gathered)."""
    logprobs, ids, vals = top_logprobs(compute_logits(params, hidden, cfg, axis), num_top)
    lp = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], 1)[:, 0]
    rank = 1 + jnp.sum(logprobs > lp[:, None], axis=-1, dtype=jnp.int32)
    return PromptOutput(lp, rank, ids, vals)
