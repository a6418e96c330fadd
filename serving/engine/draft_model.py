"""The draft model of `{"method": "draft_model", "model": DIR, ...}` on the device: a second,
smaller model with the target's tokenizer, its own weights and its own KV cache, addressed
with the target's page ids (serving/core/draft_proposer.py plans what it computes).

One program per bucket shape (T tokens, R rows, P pages per row): the draft computes the
call's T catch-up tokens (writing their K/V), takes its greedy token after each row's last
one, then runs k - 1 decode steps of R tokens on its own tokens, each writing its K/V at the
next position (rows past their look-ahead write to the sink page). It returns i32[R, k].

Proposing the draft's greedy tokens keeps the proposal one-hot, q(d) = 1, so the existing
acceptance rule (serving/engine/rejection_sampler.py: a row is emitted while every earlier
row of its request drew its proposed token) is Leviathan et al.'s rejection sampling
exactly: d is accepted with probability p(d) and a rejected row's draw follows p without d.
The target's distribution is kept for every request, greedy or sampled; only how many
tokens a step emits depends on the draft.

The shapes are the target's token and page buckets, with R the request bucket of
min(T, disable_by_batch_size): the draft adds one program per (token bucket, page bucket),
as many as the target's step programs. Without a draft model nothing here is built.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from model.batch import Batch
from model.checkpoint import param_bytes
from model.config import ModelConfig
from model.kv_cache import KVCache, bytes_per_page
from model.runtime_params import prepare_params
from model.transformer import compute_logits, forward_hidden
from serving.core.buckets import Buckets
from serving.core.draft_proposer import DraftProposer, DraftRow
from serving.core.model_source import resolve_model_source
from serving.core.spec_config import SpeculativeConfig
from serving.engine.executable_cache import (ExecutableCache, avals_signature, load_or_compile,
                                             program_for)
from serving.engine.input_prep import SINK_SLOT
from serving.engine.model_files import load_tokenizer, load_weights
from serving.engine.sizing import resolve_dtype

log = logging.getLogger("xlaserve")

_FIELDS = ("input_ids", "positions", "slot_mapping", "req_indices", "page_table",
           "logits_indices", "num_lookahead")


def _greedy(params, hidden, cfg: ModelConfig, vocab_size: int):
    return jnp.argmax(compute_logits(params, hidden, cfg)[:, :vocab_size], -1).astype(jnp.int32)


def _propose(params, cache, buffer, *, layout, cfg: ModelConfig, backend: str, k: int,
             vocab_size: int):
    """buffer: i32 arrays of _FIELDS, flat (layout: (name, shape, offset) each).
    -> (i32[R, k] greedy proposals, cache)."""
    a = {name: buffer[o:o + int(np.prod(shape))].reshape(shape) for name, shape, o in layout}
    num_lookahead = a.pop("num_lookahead")
    batch = Batch(**a)
    hidden, cache = forward_hidden(params, cache, batch, cfg, backend)
    token = _greedy(params, hidden[batch.logits_indices], cfg, vocab_size)
    R, P = batch.page_table.shape
    ps = cache.page_size
    rows = jnp.arange(R, dtype=jnp.int32)
    last = batch.positions[batch.logits_indices]

    def decode(j, carry):
        cache, token, out = carry
        pos = last + j
        live = j <= num_lookahead
        page = batch.page_table[rows, jnp.minimum(pos // ps, P - 1)]
        step = Batch(token, jnp.where(live, pos, 0),
                     jnp.where(live, page * ps + pos % ps, SINK_SLOT), rows, batch.page_table,
                     rows)
        hidden, cache = forward_hidden(params, cache, step, cfg, backend)
        token = _greedy(params, hidden, cfg, vocab_size)
        return cache, token, out.at[:, j].set(token)

    out = jnp.zeros((R, k), jnp.int32).at[:, 0].set(token)
    cache, _, out = jax.lax.fori_loop(1, k, decode, (cache, token, out))
    return out, cache


def check_compatible(draft_dir: Path, cfg: ModelConfig, tokenizer, target_tokenizer,
                     vocab_size: int) -> None:
    """The draft must speak the target's tokens: the same vocabulary (token -> id), and an
    embedding row for every id a request may use."""
    if target_tokenizer is not None:
        if tokenizer is None:
            raise ValueError(f"the draft model {draft_dir} has no tokenizer; it must have the "
                             "target model's tokenizer")
        ours, theirs = target_tokenizer.get_vocab(), tokenizer.get_vocab()
        if ours != theirs:
            differ = sorted(set(ours.items()) ^ set(theirs.items()), key=str)[:3]
            raise ValueError(
                f"the draft model {draft_dir} has another tokenizer than the target model "
                f"({len(theirs)} tokens vs {len(ours)}; differing entries such as "
                f"{differ}); speculative decoding needs the same tokenizer")
    if cfg.vocab_size < vocab_size:
        raise ValueError(f"the draft model {draft_dir} embeds {cfg.vocab_size} token ids, "
                         f"fewer than the target's {vocab_size}")


@dataclass
class DraftWarmup:
    seconds: list[float]
    loaded: int = 0
    wall: float = 0.0


class DraftModel:
    def __init__(self, model_dir: Path, cfg: ModelConfig, params, *, k: int, page_size: int,
                 backend: str, kv_cache_dtype: str | None, vocab_size: int,
                 executable_dir: str | None = None):
        self.model_dir, self.cfg, self.k = model_dir, cfg, k
        self.page_size, self.backend, self.kv_cache_dtype = page_size, backend, kv_cache_dtype
        self.vocab_size = vocab_size
        self.weight_bytes = param_bytes(params)
        self.params = prepare_params(params, free_stacked=True)
        self.page_bytes = bytes_per_page(cfg, page_size, kv_cache_dtype)
        self.cache: KVCache | None = None
        self._executable_dir = executable_dir
        self._jitted = jax.jit(partial(_propose, cfg=cfg, backend=backend, k=k,
                                       vocab_size=vocab_size),
                               donate_argnums=(1,), static_argnames=("layout",))
        self._compiled: dict[tuple[int, int, int], tuple[object, tuple]] = {}
        self.buckets: Buckets | None = None
        self.max_rows = 1

    @staticmethod
    def check_devices(spec: SpeculativeConfig | None, tensor_parallel_size: int) -> None:
        if spec and spec.method == "draft_model" and tensor_parallel_size > 1:
            raise ValueError("speculative_config: method draft_model runs on one device; "
                             "with --tensor-parallel-size > 1 use method ngram")

    @classmethod
    def for_config(cls, spec: SpeculativeConfig | None, ec, on_gpu: bool, target_tokenizer,
                   vocab_size: int, backend: str, executable_dir: str | None
                   ) -> "DraftModel | None":
        """The draft model of a draft_model config (None for none or n-gram)."""
        if spec is None or spec.method != "draft_model":
            return None
        dtype = resolve_dtype(ec.dtype, resolve_model_source(spec.model), on_gpu)
        return cls.load(spec.model, ec, dtype, target_tokenizer, vocab_size,
                        k=spec.num_speculative_tokens, backend=backend,
                        executable_dir=executable_dir)

    @classmethod
    def load(cls, model: str, ec, dtype: str | None, target_tokenizer, vocab_size: int,
             *, k: int, backend: str, executable_dir: str | None) -> "DraftModel":
        """Checks the draft against the target (before its weights load), then loads it with
        the engine's dtype, quantization and KV cache format."""
        draft_dir = resolve_model_source(model)
        if not (draft_dir / "config.json").is_file():
            raise ValueError(f"the draft model folder {draft_dir} has no config.json")
        cfg = ModelConfig.from_dir(draft_dir, dtype)
        check_compatible(draft_dir, cfg, load_tokenizer(draft_dir), target_tokenizer,
                         vocab_size)
        cfg, params = load_weights(draft_dir, ec, dtype)
        return cls(draft_dir, cfg, params, k=k, page_size=ec.page_size, backend=backend,
                   kv_cache_dtype=ec.kv_cache_dtype, vocab_size=vocab_size,
                   executable_dir=executable_dir)

    def check_max_len(self, max_model_len: int) -> None:
        if self.cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"the draft model {self.model_dir} has a context of "
                             f"{self.cfg.max_position_embeddings} tokens, shorter than "
                             f"max_model_len {max_model_len}; lower max_model_len")

    def proposer(self, spec: SpeculativeConfig, scheduler, num_pages: int, buckets: Buckets,
                 max_num_seqs: int) -> DraftProposer:
        """Checks the context, allocates the cache (the target's number of pages) and
        returns the host-side proposer that calls `run`."""
        self.check_max_len(scheduler.config.max_model_len)
        self.allocate(num_pages, buckets, min(spec.disable_by_batch_size, max_num_seqs))
        return DraftProposer(spec.num_speculative_tokens, scheduler.kv_cache_manager, self.run,
                             max(buckets.tokens), scheduler.max_len)

    def allocate(self, num_pages: int, buckets: Buckets, max_rows: int) -> None:
        """The KV cache (the target's number of pages) and the shapes a call can take."""
        self.cache = KVCache.zeros(self.cfg, num_pages, self.page_size, self.kv_cache_dtype)
        self.buckets, self.max_rows = buckets, max_rows

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        b = self.buckets
        return sorted({(t, b.pad_requests(min(t, self.max_rows)), p)
                       for t in b.tokens for p in b.pages})

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def _executables(self) -> ExecutableCache | None:
        if not self._executable_dir:
            return None
        return ExecutableCache(self._executable_dir, dict(
            program="draft", model=repr(self.cfg), params=avals_signature(self.params),
            cache=avals_signature(self.cache), backend=self.backend, k=self.k,
            page_size=self.page_size, vocab_size=self.vocab_size))

    def warmup(self, workers: int = 1) -> DraftWarmup:
        """Loads or compiles every shape, then runs the smallest once."""
        started = time.perf_counter()
        executables = self._executables()

        def compile_one(shape):
            t0 = time.perf_counter()
            buffer, layout = _pack(_padding(shape))
            args = (self.params, self.cache, buffer)
            program, loaded = load_or_compile(
                executables, lambda: self._jitted.lower(*args, layout=layout), args, shape,
                layout)
            self._compiled[shape] = (program, layout)
            return time.perf_counter() - t0, loaded

        with ThreadPoolExecutor(workers, thread_name_prefix="xlaserve-draft") as pool:
            done = list(pool.map(compile_one, self.shapes))
        self._call(_padding(self.shapes[0]))
        report = DraftWarmup([s for s, _ in done], sum(loaded for _, loaded in done),
                             time.perf_counter() - started)
        log.info("warm-up: %d draft-model programs, %d loaded, %d compiled, in %.1f s",
                 len(done), report.loaded, len(done) - report.loaded, report.wall)
        return report

    def run(self, rows: list[DraftRow]) -> list[list[int]]:
        """One call (serving.core.draft_proposer.RunDraft): per row its proposal."""
        b = self.buckets
        T = b.pad_tokens(sum(len(r.token_ids) for r in rows))
        shape = (T, b.pad_requests(min(T, self.max_rows)),
                 b.pad_pages(max(len(r.page_ids) for r in rows)))
        out = self._call(_arrays(rows, shape, self.page_size))
        return [out[i, :r.num_lookahead + 1].tolist() if r.proposes else []
                for i, r in enumerate(rows)]

    def _call(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        shape = (len(arrays["input_ids"]), *arrays["page_table"].shape)
        buffer, layout = _pack(arrays)
        program = program_for(self._compiled, shape, layout, "draft")
        out, self.cache = program(self.params, self.cache, jax.device_put(buffer))
        return np.asarray(out)


def _pack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, tuple]:
    """One int32 buffer (one transfer) and its static layout."""
    layout, offset = [], 0
    for name in _FIELDS:
        layout.append((name, arrays[name].shape, offset))
        offset += arrays[name].size
    buffer = np.concatenate([arrays[name].reshape(-1) for name in _FIELDS]).astype(np.int32)
    return buffer, tuple(layout)


def _padding(shape: tuple[int, int, int]) -> dict[str, np.ndarray]:
    T, R, P = shape
    return dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                slot_mapping=np.full(T, SINK_SLOT, np.int32),
                req_indices=np.full(T, R - 1, np.int32), page_table=np.zeros((R, P), np.int32),
                logits_indices=np.zeros(R, np.int32), num_lookahead=np.full(R, -1, np.int32))


def _arrays(rows: list[DraftRow], shape: tuple[int, int, int],
            page_size: int) -> dict[str, np.ndarray]:
    a = _padding(shape)
    t = 0
    for i, row in enumerate(rows):
        n = len(row.token_ids)
        pos = np.arange(row.start, row.start + n, dtype=np.int32)
        pages = np.asarray(row.page_ids, np.int32)
        a["page_table"][i, :len(pages)] = pages
        a["input_ids"][t:t + n] = row.token_ids
        a["positions"][t:t + n] = pos
        a["slot_mapping"][t:t + n] = pages[pos // page_size] * page_size + pos % page_size
        a["req_indices"][t:t + n] = i
        a["logits_indices"][i] = t + n - 1
        a["num_lookahead"][i] = row.num_lookahead
        t += n
    return a
