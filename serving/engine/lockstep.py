"""Data-parallel attention's host side (`-dp N --enable-expert-parallel` on a mixture of
experts; serving/engine/dp_attention.py for the device side): N ranks, each an LLMEngine's
host state (scheduler, KV pages, step arrays, outputs) over one model and one runner, that
step together. Every step schedules each rank, builds every rank's arrays in one bucket
shape (the largest any rank needs; a rank with nothing to run gets padding, vLLM's dummy
batch), runs them as one program and hands each rank its rows back. One engine thread
drives all ranks (an AsyncEngine over the LockstepEngine); `RankView`s let the
data-parallel layer (serving/engine/data_parallel.py) place requests on ranks as it places
them on replicas.
"""
from __future__ import annotations

import asyncio

from serving.core.config import EngineConfig
from serving.core.outputs import RequestOutput
from serving.engine.async_engine import AsyncEngine, EngineStats, engine_stats
from serving.engine.dp_attention import StackedStep, split_result
from serving.engine.input_prep import padding_step, step_shape
from serving.engine.llm_engine import LLMEngine


class LockstepEngine:
    """N ranks' host state stepping together (the module docstring); the engine interface
    AsyncEngine drives."""

    def __init__(self, config: EngineConfig):
        self.primary = LLMEngine(config)  # its placement spans every rank
        self.ranks = [self.primary] + [self.primary.rank_replica(rank)
                                       for rank in range(1, config.data_parallel_size)]
        self._assigned: dict[str, int] = {}  # request id -> rank, until the request is added
        self._rank_of: dict[str, int] = {}  # request id -> rank, while it runs
        p = self.primary
        self.tokenizer, self.max_model_len, self.vocab_size = (p.tokenizer, p.max_model_len,
                                                               p.vocab_size)
        self.config, self.task, self.embedder = p.config, p.task, p.embedder
        self.model_dir, self.num_pages, self.runner = p.model_dir, p.num_pages, p.runner
        self.cluster = self.kv_transfer = self.lora = self.drafter = None

    @property
    def grammar_compiler(self):
        return self.primary.grammar_compiler

    def warmup(self):
        return self.primary.warmup()

    def describe(self) -> str:
        return self.primary.describe()

    # -- requests ---------------------------------------------------------------------------

    def assign(self, request_id: str, rank: int) -> None:
        """The rank the request with this id runs on, said before it is submitted."""
        self._assigned[request_id] = rank

    def add_request(self, request_id: str, prompt_token_ids: list[int], params,
                    lora_request=None) -> None:
        rank = self._assigned.pop(request_id, 0)
        if getattr(params, "prompt_logprobs", None) is not None:
            raise ValueError("prompt_logprobs is not supported with data-parallel attention "
                             "(--data-parallel-size with --enable-expert-parallel)")
        self.ranks[rank].add_request(request_id, prompt_token_ids, params, lora_request)
        self._rank_of[request_id] = rank

    def abort(self, request_id: str) -> None:
        rank = self._rank_of.pop(request_id, None)
        for engine in self.ranks if rank is None else [self.ranks[rank]]:
            engine.abort(request_id)  # an id a rank does not know is ignored there

    def pending_on(self, rank: int) -> int:
        """Requests assigned to a rank and not added yet (they count as waiting)."""
        return sum(1 for r in list(self._assigned.values()) if r == rank)

    @property
    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished for engine in self.ranks)

    def idle_s(self) -> float | None:
        return 0.0 if self.has_unfinished else None

    def reset_prefix_cache(self) -> bool:
        if self.has_unfinished:
            return False
        return all([engine.reset_prefix_cache() for engine in self.ranks])

    def fail_all(self, error: str) -> list[RequestOutput]:
        self._rank_of.clear()
        return [out for engine in self.ranks for out in engine.fail_all(error)]

    def close(self) -> None:
        for engine in self.ranks:
            engine.close()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Every rank's step in one program (see the module docstring)."""
        plans = [engine.schedule_step() for engine in self.ranks]
        buckets, max_seqs = self.primary.buckets, self.config.max_num_seqs
        shapes = [step_shape(buckets, out.num_batched_tokens,
                             max(len(s.page_ids) for s in out.scheduled), max_seqs)
                  for out in plans if out.scheduled]
        outputs: list[RequestOutput] = []
        if not shapes:
            for engine in self.ranks:
                outputs += engine.emit_pending()
            return self._done(outputs)
        shape = tuple(max(s[i] for s in shapes) for i in range(3))
        built = [engine.prepare_step(out, None, shape) if out.scheduled else (out, None, [])
                 for engine, out in zip(self.ranks, plans)]
        hybrid = self.runner.hybrid_kv
        parts = [arrays if arrays is not None else padding_step(shape, hybrid)
                 for _, arrays, _ in built]
        handle = self.runner.dispatch(StackedStep(parts))
        for engine, (_, _, failed) in zip(self.ranks, built):
            outputs += failed + engine.emit_pending()  # detokenized while the device works
        results = split_result(self.runner.fetch(handle), len(self.ranks))
        for engine, (out, arrays, _), result in zip(self.ranks, built, results):
            if arrays is not None:
                outputs += engine.finish_step(out, arrays, result)
        return self._done(outputs)

    def _done(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for engine in self.ranks:
            if engine.kv_events:
                engine.kv_events.publish_pending()
        for out in outputs:
            if out.finished:
                self._rank_of.pop(out.request_id, None)
        return outputs


class RankView:
    """One rank of a LockstepEngine, as the data-parallel layer sees a replica: requests
    submitted through the one AsyncEngine that drives every rank, stats from the rank's own
    scheduler."""

    def __init__(self, shared: AsyncEngine, lockstep: LockstepEngine, rank: int):
        self.shared, self.lockstep, self.rank = shared, lockstep, rank
        self.engine = lockstep.ranks[rank]
        self.tokenizer, self.max_model_len = shared.tokenizer, shared.max_model_len
        self.vocab_size, self.max_logprobs = shared.vocab_size, shared.max_logprobs
        self.task, self.embedding, self.config = shared.task, shared.embedding, shared.config
        self.model_dir, self.num_pages = shared.model_dir, shared.num_pages
        # the shared engine's death is reported once, through rank 0
        self.on_dead = shared.on_dead if rank == 0 else []

    @property
    def ready(self) -> bool:
        return self.shared.ready

    @property
    def dead(self) -> str | None:
        return self.shared.dead

    def start(self, warmup: bool = True) -> None:
        if self.rank == 0:
            self.shared.start(warmup)

    def shutdown(self) -> None:
        if self.rank == 0:
            self.shared.shutdown()

    def fail_everything(self, reason: str) -> None:
        if self.rank == 0:
            self.shared.fail_everything(reason)

    def generate(self, prompt_token_ids, params, request_id: str,
                 queue: asyncio.Queue | None = None, lora_request=None):
        self.lockstep.assign(request_id, self.rank)
        return self.shared.generate(prompt_token_ids, params, request_id, queue, lora_request)

    def encode(self, prompt_token_ids, params, request_id: str, queue=None):
        raise ValueError("embeddings are not served with data-parallel attention")

    def abort(self, request_id: str) -> None:
        self.shared.abort(request_id)

    async def compile_grammar(self, structured_outputs) -> None:
        await self.shared.compile_grammar(structured_outputs)

    def stats(self) -> EngineStats:
        return engine_stats(self.engine, self.lockstep.pending_on(self.rank))

    async def reset_prefix_cache(self) -> bool:
        return await self.shared.reset_prefix_cache()

    def uses_adapter(self, digest: str) -> bool:
        return False


def build_lockstep(ec: EngineConfig, log_stats_interval_s: float | None = None
                   ) -> list[RankView]:
    """The ranks of -dp N --enable-expert-parallel, as views over one engine thread."""
    lockstep = LockstepEngine(ec)
    shared = AsyncEngine(lockstep, None)
    return [RankView(shared, lockstep, rank) for rank in range(ec.data_parallel_size)]
