"""The token bitmask on the device: constrained rows keep only the logits of their allowed
tokens (structured outputs, min_tokens), before sampling and before logprobs are taken.

The bitmask has a fixed shape per request bucket (int32[R, ceil(V / 32)]), so no grammar
ever compiles a new program; a step with no constrained row passes a device-resident
all-ones mask, and the sampler skips the mask under `lax.cond`.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.argmax_cpu import masked_argmax_rows, masked_kernel_available


def unpack_bitmask(bitmask, vocab_size: int):
    """i32[R, W] -> bool[R, vocab_size]: bit t % 32 of word t // 32 is token t."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = jnp.right_shift(bitmask[:, :, None], shifts[None, None, :]) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_token_bitmask(logits, bitmask):
    """logits: f32[R, V], bitmask: i32[R, ceil(V / 32)] -> f32[R, V] with the disallowed
    tokens at -inf."""
    return jnp.where(unpack_bitmask(bitmask, logits.shape[1]), logits, -jnp.inf)


def masked_argmax(logits, bitmask):
    """The greedy token of each row among its allowed ones: jnp.argmax of
    `apply_token_bitmask(logits, bitmask)`, by the CPU kernel where there is one (it never
    writes the masked logits)."""
    if masked_kernel_available():
        return masked_argmax_rows(logits, bitmask)
    return jnp.argmax(apply_token_bitmask(logits, bitmask), axis=-1).astype(jnp.int32)
