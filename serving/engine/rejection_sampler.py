"""Verifying proposed tokens on the device, in the step that computes their logits.

A request verifying k proposed tokens d_1..d_k has k + 1 sampled rows: row j holds the
target's logits after the request's tokens and d_1..d_j. The sampler draws every row as it
would draw that output position without speculation (penalties, bias, bitmask, filters,
temperature; its Gumbel noise keyed by the request's seed and the row's output index), and
a row's token is emitted when every earlier row of its request drew its proposed token.

That is Leviathan et al.'s rejection sampling (arXiv 2211.17192) for a proposal that puts
all its mass on one token (n-gram lookup proposes a token, not a distribution): d is
accepted with probability min(1, p(d) / q(d)) = p(d), and after a rejection the emitted
token must follow the residual max(p - q, 0) renormalised, i.e. p conditioned on "not d".
Drawing x ~ p and accepting d exactly when x = d gives both at once: P(accept) = p(d), and
given x != d, x ~ p(. | x != d). A greedy row (temperature 0) draws its argmax, so it
accepts the longest prefix of the proposal matching the target's argmax, then the bonus
token. Because an emitted row's context and noise are what the same position would have
without speculation, seeded and greedy requests produce the same tokens either way.
"""
from __future__ import annotations

import jax.numpy as jnp


def emitted_rows(tokens, draft_ids, row_start):
    """tokens: i32[R] drawn per row; draft_ids: i32[R] the proposed token each row is
    checked against (-1: the row checks none, its token is the request's last);
    row_start: i32[R] the first row of each row's request.
    -> bool[R]: the row's token is an output (no earlier row of its request rejected)."""
    rejected = ((draft_ids >= 0) & (tokens != draft_ids)).astype(jnp.int32)
    before = jnp.cumsum(rejected) - rejected  # rejections in the rows before this one
    return before == before[row_start]
