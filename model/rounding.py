"""Values rounded to their dtype (materialized) before what consumes them.

XLA:CPU fuses elementwise work into its consumers, and how it fuses can change with the
step's shape: a multiply contracted into the add that takes it (one FMA, one rounding
instead of two) in some step programs and not in others, or a softplus fused into a later
exp computed differently when a step holds one token. A row's last bits would then move
with its batch. A rounded value is computed once, in its own fusion; for products it is
also transformers' order, which rounds each product (docs/architecture.md, "Batch
invariance")."""
from __future__ import annotations

import jax


def rounded(values):
    """values (an array or a tuple of them), each materialized in its dtype."""
    return jax.lax.optimization_barrier(values)
