"""Embeddings on the device: the final norm over one block of a step's hidden states.

Every step program already returns its tokens' last hidden states (before the final norm) in
blocks of BLOCK_ROWS rows (serving/engine/prompt_logprobs.py). On an embedding engine
(`--task embed`) the runner runs one more program, `final_norm`, on each block holding a
row some request pools: the hidden state transformers' base model returns as
last_hidden_state. It has one shape whatever the step's bucket, so it is compiled (or loaded)
once at warm-up, and only when the task is embed: a generation engine builds no new program.
Pooling itself (which rows, their mean, dimensions, normalize) is host work, in
serving/core/pooling.py.
"""
from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.layers import norm
from model.runtime_params import prepare_params
from serving.engine.prompt_logprobs import BLOCK_ROWS


def final_norm(params, hidden, *, cfg: ModelConfig):
    """hidden: [BLOCK_ROWS, H] from hidden_blocks -> f32[BLOCK_ROWS, H] after the final
    norm. On CPUs each row is normalised alone (rms_norm), so a row's value does not depend
    on the others in its block."""
    params = prepare_params(params)
    x = norm(cfg).apply({"params": params["final_norm"]}, hidden)
    return x.astype(jnp.float32)


class PoolingProgram:
    """The final-norm program of one runner: compiled at warm-up, launched on the blocks a
    step's pooled rows fall in, fetched as one f32[T, H] array."""

    def __init__(self, runner):
        self.runner = runner
        where = runner.placement
        self._jitted = jax.jit(where.wrap_pool(partial(final_norm, cfg=where.model_cfg)))
        self._program = None

    def compile(self) -> tuple[float, bool]:
        """Loads it from the executable cache or compiles it: (seconds, loaded)."""
        started = time.perf_counter()
        r = self.runner
        hidden = jax.ShapeDtypeStruct((BLOCK_ROWS, r.cfg.hidden_size), r.cfg.dtype)
        args = (r.params, hidden)
        self._program, loaded = r._load_or_compile(
            lambda: self._jitted.lower(*args), args, ("pooling", BLOCK_ROWS), "pooling")
        return time.perf_counter() - started, loaded

    def launch(self, blocks, rows: np.ndarray):
        """rows: bool[T] the step's pooled rows -> (T, [(block index, its device output)])."""
        if self._program is None:
            raise RuntimeError("the pooling program was not compiled at warm-up")
        launched = []
        for i, block in enumerate(blocks):
            if rows[i * BLOCK_ROWS:(i + 1) * BLOCK_ROWS].any():
                out = self._program(self.runner.params, block)
                out.copy_to_host_async()
                launched.append((i, out))
        return len(rows), launched

    def fetch(self, handle) -> np.ndarray:
        """-> f32[T, H]: the normed rows of the launched blocks (other rows are zeros)."""
        T, launched = handle
        n = -(-T // BLOCK_ROWS) * BLOCK_ROWS
        full = np.zeros((n, self.runner.cfg.hidden_size), np.float32)
        for i, out in launched:
            full[i * BLOCK_ROWS:(i + 1) * BLOCK_ROWS] = self.runner.placement.host(out)
        return full[:T]
