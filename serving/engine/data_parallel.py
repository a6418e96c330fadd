"""Data parallelism in one server (vLLM's `--data-parallel-size`, `-dp`): N replicas of a
tensor-parallel group, each an engine with its own scheduler, KV cache and step loop over
devices of its own (replica r takes devices r*TP .. r*TP+TP-1), behind one HTTP endpoint.

`DataParallelEngine` answers the server as one AsyncEngine does and places each request on
a replica: the one `X-data-parallel-rank` names (serving/core/dp_rank.py), else the one whose
prefix cache holds the longest run of the prompt's leading pages, else (and when that one is
busier than the least loaded by more than BALANCE_SLACK) the least loaded by vLLM's score,
4 x waiting + running. A request stays on its replica for its life; `--max-num-seqs` is per
replica, as in vLLM. With --enable-expert-parallel on a mixture of experts, or over several
processes (jax.distributed), the replicas are the ranks of one program instead (attention
data parallel, experts over every device: serving/engine/lockstep.py), placed the same way. docs/architecture.md, "Fleets: routers,
data parallelism and disaggregation".
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging

from serving.core.config import EngineConfig
from serving.core.dp_rank import requested_rank
from serving.core.kv_cache_manager import page_keys
from serving.core.page_hash import hash_pages
from serving.engine.async_engine import AsyncEngine, EngineStats

log = logging.getLogger("xlaserve")

# A replica with the best prefix hit still loses the request to the least loaded one when
# its load score is higher by more than this (a shared system prompt must not pin every
# request to one replica).
BALANCE_SLACK = 8


def check_config(ec: EngineConfig, num_devices: int | None) -> None:
    """vLLM's rules for -dp, before anything loads (num_devices None: not counted here)."""
    n, tp = ec.data_parallel_size, ec.tensor_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {n}")
    if n == 1:
        return
    if ec.enable_lora:
        raise ValueError("--enable-lora is not supported with --data-parallel-size > 1")
    if ec.kv_transfer_config:
        raise ValueError("--kv-transfer-config is not supported with --data-parallel-size > 1; "
                         "run one prefill and one decode server per replica")
    if num_devices is not None and n * tp > num_devices:
        raise ValueError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs "
                         f"{n * tp} devices; there are {num_devices}")


def build_replicas(ec: EngineConfig, log_stats_interval_s: float | None = 10.0
                   ) -> "DataParallelEngine":
    """N LLMEngines, each built on its replica's first device as JAX's default (weights,
    KV cache, programs), wrapped in AsyncEngines that keep that default for warm-up and
    steps. The KV cache of every replica is sized as the first one's."""
    if ec.enable_expert_parallel or ec.num_processes > 1:
        # one program over every rank (serving/engine/lockstep.py); its devices are counted
        # once the engine has joined the other processes' runtime
        check_config(ec, None)
        from serving.engine.lockstep import build_lockstep
        return DataParallelEngine(build_lockstep(ec, log_stats_interval_s))
    import jax

    from serving.engine.llm_engine import LLMEngine
    check_config(ec, len(jax.devices()))
    replicas, kv_memory = [], ec.kv_cache_memory
    for rank in range(ec.data_parallel_size):
        device = jax.devices()[rank * ec.tensor_parallel_size]
        config = dataclasses.replace(ec, data_parallel_rank=rank, kv_cache_memory=kv_memory,
                                     progress=ec.progress and rank == 0)
        with jax.default_device(device):
            engine = LLMEngine(config)
        if rank == 0 and kv_memory is None:
            kv_memory = engine.kv_cache_bytes // engine.placement.size
        replicas.append(AsyncEngine(engine, log_stats_interval_s,
                                    scope=functools.partial(jax.default_device, device)))
    return DataParallelEngine(replicas)


class DataParallelEngine:
    """The AsyncEngine interface over N replicas (see the module docstring)."""

    def __init__(self, replicas: list[AsyncEngine]):
        self.replicas = replicas
        first = replicas[0]
        self.engine = first.engine  # what warm-up summaries and descriptions read
        self.tokenizer, self.max_model_len = first.tokenizer, first.max_model_len
        self.vocab_size, self.max_logprobs = first.vocab_size, first.max_logprobs
        self.task, self.embedding = first.task, first.embedding
        self.config = dataclasses.replace(first.config, data_parallel_rank=0)
        self.model_dir, self.num_pages = first.model_dir, first.num_pages
        self.on_dead: list = []
        self._died = False
        for replica in replicas:
            replica.on_dead.append(self._one_died)

    # -- state ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.replicas)

    @property
    def dead(self) -> str | None:
        return next((f"replica {i}: {r.dead}" for i, r in enumerate(self.replicas)
                     if r.dead is not None), None)

    def _one_died(self) -> None:
        """One replica dead: the server stops (as it does for one engine); the others'
        requests finish or are aborted by the drain."""
        if not self._died:
            self._died = True
            for callback in self.on_dead:
                callback()

    def start(self, warmup: bool = True) -> None:
        for replica in self.replicas:
            replica.start(warmup)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def close(self) -> None:
        """What runs beside each replica's engine (its KV event publisher)."""
        for replica in self.replicas:
            replica.engine.close()

    def fail_everything(self, reason: str) -> None:
        for replica in self.replicas:
            replica.fail_everything(reason)

    # -- requests ---------------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[int], params, request_id: str,
                 queue: asyncio.Queue | None = None, lora_request=None):
        rank = self.place(prompt_token_ids, params)
        return self.replicas[rank].generate(prompt_token_ids, params, request_id, queue,
                                            lora_request)

    def encode(self, prompt_token_ids: list[int], params, request_id: str,
               queue: asyncio.Queue | None = None):
        rank = self.place(prompt_token_ids, None)
        return self.replicas[rank].encode(prompt_token_ids, params, request_id, queue)

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:  # unknown ids are ignored by the others
            replica.abort(request_id)

    async def compile_grammar(self, structured_outputs) -> None:
        """On every replica's compiler: the request may be placed on any of them."""
        await asyncio.gather(*(r.compile_grammar(structured_outputs) for r in self.replicas))

    def place(self, prompt_token_ids: list[int], params) -> int:
        """The replica for a new request (the module docstring's rule)."""
        rank = requested_rank.get()
        if rank is not None:
            return rank
        scores = [4 * s.num_waiting + s.num_running for s in self.replica_stats()]
        least = min(range(len(scores)), key=scores.__getitem__)
        hits = self.prefix_hits(prompt_token_ids, params)
        best = max(range(len(hits)), key=lambda r: (hits[r], -scores[r]))
        if hits[best] and scores[best] - scores[least] <= BALANCE_SLACK:
            return best
        return least

    def prefix_hits(self, prompt_token_ids: list[int], params) -> list[int]:
        """Per replica, the leading pages of the prompt its prefix cache holds (read from
        the server's thread: a stale answer only moves a request to another replica)."""
        first = self.replicas[0].engine.scheduler.kv_cache_manager
        if not first.enable_caching:
            return [0] * len(self.replicas)
        salt = getattr(params, "cache_salt", None)
        usable = (len(prompt_token_ids) - 1) // first.page_size * first.page_size
        hashes = hash_pages(prompt_token_ids[:usable], first.page_size,
                            page_keys(first.model_key, None, salt))
        hits = []
        for replica in self.replicas:
            allocator = replica.engine.scheduler.kv_cache_manager.allocator
            n = 0
            while n < len(hashes) and allocator.lookup(hashes[n]) is not None:
                n += 1
            hits.append(n)
        return hits

    # -- what the server reads --------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The replicas together (KV usage: their mean, as they have equal caches)."""
        each = self.replica_stats()
        return EngineStats(
            sum(s.num_running for s in each), sum(s.num_waiting for s in each),
            sum(s.kv_cache_usage for s in each) / len(each),
            sum(s.num_preemptions_total for s in each),
            sum(s.prefix_cache_queries for s in each), sum(s.prefix_cache_hits for s in each),
            sum(s.num_prompt_tokens_total for s in each),
            sum(s.num_generation_tokens_total for s in each), _spec(each))

    def replica_stats(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    async def reset_prefix_cache(self) -> bool:
        results = await asyncio.gather(*(r.reset_prefix_cache() for r in self.replicas))
        return all(results)

    @property
    def lora(self):
        return None  # refused with -dp (check_config)

    def uses_adapter(self, digest: str) -> bool:
        return any(r.uses_adapter(digest) for r in self.replicas)


def _spec(each: list[EngineStats]):
    """Speculative decoding's running totals over the replicas (None when off)."""
    specs = [s.spec for s in each if s.spec is not None]
    if not specs:
        return None
    total = dataclasses.replace(specs[0])
    for s in specs[1:]:
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        total.accepted_per_pos = [a + b for a, b in zip(total.accepted_per_pos,
                                                        s.accepted_per_pos)]
    return total
