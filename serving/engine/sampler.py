"""On-device sampling, vectorised over the batch: one row per request, no Python branches on
per-request values.

Work that no request in the step needs (penalties, bias, filters, random draws, logprobs) is
skipped with `lax.cond` on a CPU, where the conditional costs nothing and the skipped work is
most of a small step. On a GPU a conditional's predicate is copied to the host before the
branch is launched, which stalls dispatch and undoes the overlap of host work with the device
step: there every stage runs and `jnp.where` picks its result (`branch_mode`)."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.argmax_cpu import argmax_rows
from serving.engine.token_bitmask import apply_token_bitmask, masked_argmax

# Top logprobs computed when any request asks; each keeps its own count. The engine passes its
# max_logprobs cap (vLLM's --max-logprobs), whose default this is.
NUM_TOP_LOGPROBS = 20


@jax.tree_util.register_dataclass
@dataclass
class SamplingInputs:
    temperature: jax.Array  # f32[R], 0 = greedy
    top_k: jax.Array  # i32[R], 0 = off
    top_p: jax.Array  # f32[R]
    min_p: jax.Array  # f32[R]
    seed: jax.Array  # u32[R]
    output_index: jax.Array  # i32[R] index of the token being sampled in the request's output
    repetition_penalty: jax.Array  # f32[R]
    presence_penalty: jax.Array  # f32[R]
    frequency_penalty: jax.Array  # f32[R]
    history: jax.Array  # i32[R, S] prompt + output tokens, -1 padded (only when penalised)
    num_prompt: jax.Array  # i32[R] entries of history before this index are prompt tokens
    bias_ids: jax.Array  # i32[R, NB], -1 padded
    bias_values: jax.Array  # f32[R, NB]
    any_penalty: jax.Array  # bool[]
    any_bias: jax.Array  # bool[]
    any_filter: jax.Array  # bool[] top-k, top-p or min-p in use
    any_random: jax.Array  # bool[] some row has temperature > 0
    any_logprobs: jax.Array  # bool[]
    # Constrained rows (structured outputs, min_tokens): serving/engine/token_bitmask.py.
    any_masked: jax.Array | None = None  # bool[] some row is constrained
    token_bitmask: jax.Array | None = None  # i32[R, ceil(V / 32)] allowed tokens


@jax.tree_util.register_dataclass
@dataclass
class SampleOutput:
    tokens: jax.Array  # i32[R]
    logprob: jax.Array  # f32[R] of the sampled token under the model's distribution
    top_ids: jax.Array  # i32[R, K] K = num_top
    top_logprobs: jax.Array  # f32[R, K]


def apply_penalties(logits, s: SamplingInputs):
    R, V = logits.shape
    valid = s.history >= 0
    ids = jnp.where(valid, s.history, 0)
    rows = jnp.arange(R)[:, None]
    is_output = valid & (jnp.arange(s.history.shape[1])[None, :] >= s.num_prompt[:, None])
    seen = jnp.zeros((R, V), bool).at[rows, ids].max(valid)
    counts = jnp.zeros((R, V), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * (counts > 0)


def apply_bias(logits, s: SamplingInputs):
    rows = jnp.arange(logits.shape[0])[:, None]
    valid = s.bias_ids >= 0
    return logits.at[rows, jnp.where(valid, s.bias_ids, 0)].add(
        jnp.where(valid, s.bias_values, 0.0))


def apply_filters(logits, s: SamplingInputs):
    """Masks tokens outside top-k, top-p (nucleus) and min-p, all on one descending sort."""
    V = logits.shape[1]
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    vals = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(vals / temp, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, V)[:, None]
    # top_p == 1 must keep everything: a float32 cumsum reaches 1.0 before the tail does.
    keep = (rank < k) & ((jnp.cumsum(probs, -1) - probs < s.top_p[:, None])
                         | (s.top_p[:, None] >= 1.0))
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _gumbel(s: SamplingInputs, shape):
    def row(seed, index):
        return jax.random.gumbel(jax.random.fold_in(jax.random.PRNGKey(seed), index), shape[1:])
    return jax.vmap(row)(s.seed, s.output_index)


def row_log_softmax(logits):
    """log_softmax over each row of f32[N, V], one row at a time: XLA's reductions over
    [N, V] sum a row in an order that depends on N, so a row's logprobs changed in their last
    bits with the rows beside it. Each row as its own [V] computation sums the same way
    whatever N is (docs/architecture.md, "Batch invariance"). Off CPUs (GPUs make no such
    promise) the one batched op."""
    if jax.default_backend() != "cpu":
        return jax.nn.log_softmax(logits, axis=-1)
    return jax.lax.map(jax.nn.log_softmax, logits)


def top_logprobs(logits, num_top: int):
    """logits: f32[N, V] -> (logprobs f32[N, V], top ids i32[N, K], their logprobs f32[N, K])."""
    logprobs = row_log_softmax(logits)
    vals, ids = jax.lax.top_k(logprobs, max(num_top, 1))
    return logprobs, ids.astype(jnp.int32), vals


BRANCH_MODES = ("cond", "select")


def branch_mode() -> str:
    """"cond" on a CPU (skipped work is saved), "select" elsewhere (no host round trip)."""
    return "cond" if jax.default_backend() == "cpu" else "select"


def _when(mode: str, flag, stage, otherwise, *operands):
    """stage(*operands) where flag (a bool[] scalar) holds, else otherwise(*operands)."""
    if mode == "cond":
        return jax.lax.cond(flag, stage, otherwise, *operands)
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), stage(*operands),
                        otherwise(*operands))


def sample(logits, s: SamplingInputs, num_top: int = NUM_TOP_LOGPROBS,
           mode: str | None = None) -> SampleOutput:
    """logits: f32[R, V] -> one token per row (see sample_rows)."""
    return sample_rows(logits, lambda l: l, s, num_top, mode)


def sample_rows(rows, head, s: SamplingInputs, num_top: int = NUM_TOP_LOGPROBS,
                mode: str | None = None, greedy=None) -> SampleOutput:
    """rows: [R, ...] that `head` turns into logits f32[R, V] (the final hidden states of the
    sampled tokens, or the logits themselves with the identity). greedy: rows -> i32[R], the
    argmax tokens without the logits (model/greedy_head.py), for a step where every row is
    greedy, unconstrained and asks for nothing else; None: the argmax of head(rows).

    A step with a constrained row masks the logits first (logprobs see the constrained
    distribution); any other step runs `_sample` as if there were no bitmask. (The mask
    inside `_sample` slowed XLA:CPU's plain greedy path ten times at 64 rows, masked or not.)
    Under "select" the mask is always applied: an all-ones mask changes nothing."""
    mode = mode or branch_mode()
    if mode not in BRANCH_MODES:
        raise ValueError(f"unknown branch mode {mode!r}; choose one of {BRANCH_MODES}")
    if mode == "select" or greedy is None:  # the logits once, before any branch
        rows, head = head(rows), (lambda l: l)
    if mode == "select":
        return _sample(rows, head, s, num_top, mode, s.token_bitmask)
    if s.token_bitmask is None:
        return _sample(rows, head, s, num_top, mode, greedy=greedy)
    return jax.lax.cond(s.any_masked,
                        lambda r: _sample(r, head, s, num_top, mode, s.token_bitmask),
                        lambda r: _sample(r, head, s, num_top, mode, greedy=greedy), rows)


def _sample(rows, head, s: SamplingInputs, num_top: int, mode: str,
            bitmask=None, greedy=None) -> SampleOutput:
    """One token per row of head(rows). Each row's randomness depends only on its seed
    and output index, so a request samples the same tokens whatever else is in the batch.
    A step of greedy requests asking for nothing else takes the argmax alone (under "cond"),
    over the allowed tokens when there is a bitmask: the masked logits are then never
    written (XLA:CPU took milliseconds at 64 rows to write them and pass them into the
    branch); with `greedy`, not even the logits are. mode: one of BRANCH_MODES."""
    R = rows.shape[0]
    K = max(num_top, 1)

    def masked(raw):
        return raw if bitmask is None else apply_token_bitmask(raw, bitmask)

    def plain(r):
        if bitmask is not None:
            tokens = masked_argmax(head(r), bitmask)
        else:
            tokens = greedy(r) if greedy is not None else argmax_rows(head(r))
        return SampleOutput(tokens, jnp.zeros((R,), jnp.float32),
                            jnp.zeros((R, K), jnp.int32), jnp.zeros((R, K), jnp.float32))

    if mode == "select":  # every stage below selects its own result: no outer branch
        return _sample_any(masked(head(rows)), s, K, mode)
    extra = s.any_penalty | s.any_bias | s.any_random | s.any_logprobs
    return jax.lax.cond(extra, lambda r: _sample_any(masked(head(r)), s, K, mode), plain, rows)


def _sample_any(logits, s: SamplingInputs, K: int, mode: str) -> SampleOutput:
    R, V = logits.shape
    raw = logits
    unchanged = lambda l, _: l  # noqa: E731
    logits = _when(mode, s.any_penalty, apply_penalties, unchanged, logits, s)
    logits = _when(mode, s.any_bias, apply_bias, unchanged, logits, s)
    greedy = argmax_rows(logits)

    def random_tokens(logits):
        filtered = _when(mode, s.any_filter, apply_filters, unchanged, logits, s)
        temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
        return argmax_rows(filtered / temp + _gumbel(s, (R, V)))

    drawn = _when(mode, s.any_random, random_tokens, lambda l: greedy, logits)
    tokens = jnp.where(s.temperature > 0, drawn, greedy)

    def logprob_outputs(raw):
        logprobs, ids, vals = top_logprobs(raw, K)
        return jnp.take_along_axis(logprobs, tokens[:, None], 1)[:, 0], ids, vals

    def no_logprobs(raw):
        return (jnp.zeros((R,), jnp.float32), jnp.zeros((R, K), jnp.int32),
                jnp.zeros((R, K), jnp.float32))

    logprob, top_ids, top_vals = _when(mode, s.any_logprobs, logprob_outputs, no_logprobs, raw)
    return SampleOutput(tokens, logprob, top_ids, top_vals)
