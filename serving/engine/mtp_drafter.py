"""Multi-token prediction as speculative decoding (`{"method": "mtp", "num_speculative_tokens":
k}`, vLLM's name; `deepseek_mtp` too): the checkpoint's next-n layer (model/mtp.py) drafts
from the target's own hidden states, with a latent cache of its own beside the target's.

Right after each target step is launched, one program of the same bucket shape runs the
layer over every token of that step, on the device, from the step's outputs: token i's
hidden state h_i and the token after it (the next prompt token, known on the host, or, at a
sampled row, the token the target just drew there). It writes the layer's latent for each
position, addressed with the target's page ids (so prefilled, verified and prefix-cached
positions hold it for later steps), and has its greedy guess at every sampled row.

For k > 1 the same layer then runs k - 1 more times, chained as transformers' MtpModel
chains depths: at each request's last emitted row (found on the device from the step's
accepted rows), from its own head-normed output and its last guess, one position further
each time, writing its latent there. The scheduler gives a sampling step pages for those
positions (SchedulerConfig.num_lookahead_tokens; where pages are short, or past the page
table, a write lands on the sink page, which only costs the guess). The next step's pass
rewrites them from the real tokens. The released checkpoints have one next-n layer; vLLM reuses
it the same way.

After the step, each request that may verify proposes the guesses of its last emitted row:
the tokens after the one it just got. A draft never changes what is emitted: the target's
verification (serving/engine/rejection_sampler.py) accepts a greedy proposal with
probability p(d), so greedy and seeded outputs equal plain decoding. The drafter compiles
one program per target step shape at warm-up.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model.batch import Batch
from model.config import ModelConfig
from model.kv_cache import KVCache, bytes_per_page
from model.mtp import (load_mtp_params, mtp_apply, mtp_chain_state, mtp_config, mtp_hidden,
                       mtp_logits, prepare_mtp)
from serving.core.request import Request
from serving.core.scheduler import SchedulerOutput
from serving.core.spec_config import SpeculativeConfig
from serving.engine.draft_model import DraftWarmup
from serving.engine.executable_cache import (ExecutableCache, avals_signature, load_or_compile,
                                             program_for)
from serving.engine.input_prep import SINK_SLOT
from serving.engine.prompt_logprobs import BLOCK_ROWS

log = logging.getLogger("xlaserve")

def _draft(params, mtp, cache, arrays, blocks, sampled, emitted, *, cfg: ModelConfig,
           backend: str, vocab_size: int, k: int):
    """-> (i32[R, k] the layer's greedy guesses from each sampled row, the layer's cache).
    Column 0 at every sampled row; columns 1.. only at each request's last emitted row."""
    T = arrays["positions"].shape[0]
    hidden = jnp.concatenate(blocks)[:T]
    rows = arrays["next_rows"]
    next_ids = jnp.where(rows >= 0, sampled[jnp.maximum(rows, 0)], arrays["next_ids"])
    batch = Batch(next_ids, arrays["positions"], arrays["slot_mapping"],
                  arrays["req_indices"], arrays["page_table"], arrays["logits_indices"])
    h, cache = mtp_hidden(params, mtp, cache, batch, hidden, next_ids, cfg, backend)
    greedy = lambda x: jnp.argmax(mtp_logits(params, mtp, x, cfg)[:, :vocab_size],
                                  axis=-1).astype(jnp.int32)
    x = h[batch.logits_indices]
    guess = greedy(x)
    out = jnp.zeros((guess.shape[0], k), jnp.int32).at[:, 0].set(guess)
    if k == 1:
        return out, cache
    live = _last_emitted(emitted, arrays["row_start"], arrays["num_rows"])
    R, P = batch.page_table.shape
    ps = cache.page_size
    req = batch.req_indices[batch.logits_indices]
    last = batch.positions[batch.logits_indices]

    def chained(j, carry):
        cache, x, guess, out = carry
        pos = last + j
        ok = live & (pos // ps < P)  # past the page table: the row rests
        page = batch.page_table[req, jnp.minimum(pos // ps, P - 1)]
        step = Batch(guess, jnp.where(ok, pos, 0), jnp.where(ok, page * ps + pos % ps,
                                                              SINK_SLOT),
                     req, batch.page_table, jnp.arange(R, dtype=jnp.int32))
        x, cache = mtp_apply(params, mtp, cache, step, mtp_chain_state(mtp, x, cfg), guess,
                             cfg, backend)
        guess = greedy(x)
        return cache, x, guess, out.at[:, j].set(guess)

    cache, _, _, out = jax.lax.fori_loop(1, k, chained, (cache, x, guess, out))
    return out, cache


def _last_emitted(emitted, row_start, num_rows):
    """bool[R]: the row is its request's last emitted row (the step's real rows are the first
    num_rows; a request's emitted rows come first among its rows)."""
    R = emitted.shape[0]
    real = jnp.arange(R) < num_rows
    after = jnp.concatenate([emitted[1:] & (row_start[1:] == row_start[:-1]) & real[1:],
                             jnp.zeros((1,), bool)])
    return real & emitted & ~after


def step_inputs(out: SchedulerOutput, first_rows: list[int], T: int) -> dict[str, np.ndarray]:
    """Each step token's next token: `next_ids` where the host knows it (the prompt, or
    tokens it already has), else `next_rows`, the sampled row whose token follows it."""
    next_ids, next_rows = np.zeros(T, np.int32), np.full(T, -1, np.int32)
    j = 0
    for s, first in zip(out.scheduled, first_rows):
        n, rows = s.num_new_tokens, s.num_rows
        for i in range(n):
            if s.samples and i >= n - rows:
                next_rows[j + i] = first + i - (n - rows)
            elif i + 1 < n:
                next_ids[j + i] = s.token_ids[i + 1]
            else:  # the end of a prefill chunk: the prompt goes on
                next_ids[j + i] = s.request.all_token_ids[s.start + n]
        j += n
    return dict(next_ids=next_ids, next_rows=next_rows)


class MtpDrafter:
    """Beside the target like a draft model (serving/engine/draft_model.py): its cache has a
    page for every page of the target's, sized with it."""

    def __init__(self, cfg: ModelConfig, mtp, *, k: int, page_size: int, backend: str,
                 kv_cache_dtype: str | None, vocab_size: int, executable_dir: str | None):
        self.cfg, self.k, self.page_size, self.backend = cfg, k, page_size, backend
        self.kv_cache_dtype, self.vocab_size = kv_cache_dtype, vocab_size
        self.mtp = jax.device_put(prepare_mtp(jax.tree.map(jnp.asarray, mtp)))
        self.page_bytes = bytes_per_page(mtp_config(cfg), page_size, kv_cache_dtype)
        self.cache: KVCache | None = None
        self._executable_dir = executable_dir
        self._jitted = jax.jit(partial(_draft, cfg=cfg, backend=backend, vocab_size=vocab_size,
                                       k=k), donate_argnums=(2,))
        self._compiled: dict[tuple[int, int, int], tuple[object, tuple]] = {}
        self._launched = None  # the last step's (out, first rows, emitted, guesses)
        self.shapes: list[tuple[int, int, int]] = []

    @classmethod
    def for_config(cls, spec: SpeculativeConfig, ec, model_dir, cfg: ModelConfig,
                   vocab_size: int, backend: str, executable_dir: str | None):
        if not cfg.num_mtp_layers:
            raise ValueError(f"speculative_config: method {spec.method} needs a model with "
                             f"next-n prediction layers; {cfg.architecture} in {model_dir} "
                             "has none (num_nextn_predict_layers)")
        k = spec.num_speculative_tokens
        if k > cfg.num_mtp_layers:
            log.info("speculative decoding: %d guesses a step from %d next-n layer(s): the "
                     "first layer runs %d times, each on its own last guess", k,
                     cfg.num_mtp_layers, k)
        if ec.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config: method {spec.method} runs on one device; "
                             "with --tensor-parallel-size > 1 use method ngram")
        mtp = load_mtp_params(model_dir, cfg) if ec.load_format != "dummy" else None
        if mtp is None:
            from model.mtp import abstract_mtp
            mtp = jax.tree.map(lambda a: jnp.full(a.shape, 0.02, a.dtype), abstract_mtp(cfg))
        return cls(cfg, mtp, k=k, page_size=ec.page_size, backend=backend,
                   kv_cache_dtype=ec.kv_cache_dtype, vocab_size=vocab_size,
                   executable_dir=executable_dir)

    def proposer(self, spec: SpeculativeConfig, scheduler, num_pages: int, buckets,
                 max_num_seqs: int) -> "MtpProposer":
        from serving.engine.input_prep import all_step_shapes
        self.cache = KVCache.zeros(mtp_config(self.cfg), num_pages, self.page_size,
                                   self.kv_cache_dtype)
        self.shapes = all_step_shapes(buckets, max_num_seqs)
        return MtpProposer(self, scheduler.max_len)

    def _arrays(self, shape, out: SchedulerOutput | None = None, step=None) -> dict:
        T, R, P = shape
        if out is None:
            return dict(positions=np.zeros(T, np.int32),
                        slot_mapping=np.full(T, SINK_SLOT, np.int32),
                        req_indices=np.full(T, R - 1, np.int32),
                        page_table=np.zeros((R, P), np.int32),
                        logits_indices=np.zeros(R, np.int32),
                        next_ids=np.zeros(T, np.int32), next_rows=np.full(T, -1, np.int32),
                        row_start=np.arange(R, dtype=np.int32), num_rows=np.int32(0))
        batch = step.batch
        return dict(positions=batch["positions"], slot_mapping=batch["slot_mapping"],
                    req_indices=batch["req_indices"], page_table=batch["page_table"],
                    logits_indices=batch["logits_indices"], row_start=batch["row_start"],
                    num_rows=np.int32(sum(s.num_rows for s in out.scheduled)),
                    **step_inputs(out, step.first_rows, T))

    def _args(self, params, shape, arrays):
        T, R, _ = shape
        blocks = tuple(jax.ShapeDtypeStruct((BLOCK_ROWS, self.cfg.hidden_size), self.cfg.dtype)
                       for _ in range(-(-T // BLOCK_ROWS)))
        return (params, self.mtp, self.cache, arrays, blocks,
                jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.bool_))

    def warmup(self, params, workers: int = 1) -> DraftWarmup:
        """Loads or compiles the program of every target step shape."""
        started = time.perf_counter()
        executables = (ExecutableCache(self._executable_dir, dict(
            program="mtp", model=repr(self.cfg), params=avals_signature(params),
            mtp=avals_signature(self.mtp), cache=avals_signature(self.cache),
            backend=self.backend, vocab_size=self.vocab_size, k=self.k))
            if self._executable_dir else None)

        def compile_one(shape):
            t0 = time.perf_counter()
            args = self._args(params, shape, self._arrays(shape))
            program, loaded = load_or_compile(executables, lambda: self._jitted.lower(*args),
                                              args, shape, "mtp")
            self._compiled[shape] = (program, "mtp")
            return time.perf_counter() - t0, loaded

        with ThreadPoolExecutor(workers, thread_name_prefix="xlaserve-mtp") as pool:
            done = list(pool.map(compile_one, self.shapes))
        report = DraftWarmup([s for s, _ in done], sum(loaded for _, loaded in done),
                             time.perf_counter() - started)
        log.info("warm-up: %d next-n prediction programs, %d loaded, %d compiled, in %.1f s",
                 len(done), report.loaded, len(done) - report.loaded, report.wall)
        return report

    def launch(self, out: SchedulerOutput, step, runner) -> None:
        """Right after the target step `step` (input_prep.StepArrays) is launched: the layer
        over its tokens, on the device, from the step's hidden states and samples."""
        sampled, emitted, blocks = runner.last_step
        program = program_for(self._compiled, step.shape, "mtp", "mtp")
        arrays = jax.device_put(self._arrays(step.shape, out, step))
        guesses, self.cache = program(runner.params, self.mtp, self.cache, arrays, blocks,
                                      sampled, emitted)
        guesses.copy_to_host_async()
        self._launched = (out, step.first_rows, emitted, guesses)

    def guesses(self) -> dict[str, list[int]]:
        """The last step's guesses for each request it sampled: those of its last emitted
        row (the k tokens after the one the request just got)."""
        if self._launched is None:
            return {}
        out, first_rows, emitted, guesses = self._launched
        self._launched = None
        emitted, guesses = np.asarray(emitted), np.asarray(guesses)
        found = {}
        for s, first in zip(out.scheduled, first_rows):
            count = int(emitted[first:first + s.num_rows].sum()) if s.samples else 0
            if count:
                found[s.request.request_id] = guesses[first + count - 1].tolist()
        return found


class MtpProposer:
    """The host side: proposals from the last step's guesses (spec_decode.Drafter calls
    propose for the running requests that may verify)."""

    def __init__(self, drafter: MtpDrafter, max_len: int):
        self.drafter, self.max_len = drafter, max_len

    def propose(self, requests: list[Request]) -> None:
        guesses = self.drafter.guesses()
        for req in requests:
            room = min(req.max_tokens - req.num_output_tokens - 1,
                       self.max_len - req.num_tokens - 1)
            req.spec_token_ids = guesses.get(req.request_id, [])[:max(room, 0)]
