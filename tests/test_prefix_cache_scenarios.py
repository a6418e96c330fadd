"""Thousands of random schedules over the scheduler and KV cache manager, no JAX: arrivals
with shared prefixes (system prompts, multi-turn histories, n samples of one prompt, cache
salts), chunked prefill, preemption, aborts, requests that skip the cache. A simulated
device writes, per KV slot, what a real one would: the identity of the token's whole prefix.
After every step and every operation the books are checked:

- every usable page is free xor referenced, and its ref count is the number of page
  tables holding it;
- a request reads only K/V of its own prefix (what a cache hit maps in is right), and
  writes only to pages nobody else holds and that are not cached;
- a cached page's hash matches the tokens it holds;
- once every request has ended, no page is referenced;
- with speculation (random proposals, random acceptance, at times pages taken for a
  look-ahead past each sampling step), K/V written for a rejected proposed token is never
  read or cached, and its pages go back;
- on a sliding-window model, every key a step reads is still held (pages behind the window
  are SINK entries, a leading run), and a request holds no more pages than the window
  bound the scheduler admits by.
"""
import functools
import random

import pytest

from serving.core.kv_window import num_skipped_pages
from serving.core.page_allocator import SINK_PAGE
from serving.core.page_hash import hash_pages
from serving.core.request import Request, RequestStatus
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, cdiv

EOS = 0


class FakeDevice:
    """slot -> (extra keys, the token ids up to and including the one at that slot)."""

    def __init__(self, sched: Scheduler):
        self.sched, self.kv = sched, {}

    def key(self, req: Request, pos: int, spec: list[int] = ()):
        tokens = req.all_token_ids + list(spec)  # proposed tokens are keyed as if accepted
        return (self.sched.kv_cache_manager.extra_keys(req), tuple(tokens[:pos + 1]))

    def run(self, out: SchedulerOutput) -> None:
        ps, alloc = self.sched.config.page_size, self.sched.allocator
        for s in out.scheduled:
            r = s.request
            window = self.sched.config.sliding_window
            for pos in range(max(s.start - window + 1, 0) if window else 0, s.start):
                # what attention reads
                slot = s.page_ids[pos // ps] * ps + pos % ps
                assert self.kv.get(slot) == self.key(r, pos), "read K/V of another prefix"
            for pos in range(s.start, s.start + s.num_new_tokens):  # what it writes
                page = s.page_ids[pos // ps]
                assert alloc.ref_count(page) == 1 and alloc.page_hash(page) is None, \
                    "wrote to a shared or cached page"
                self.kv[page * ps + pos % ps] = self.key(r, pos, s.spec_token_ids)


def check_books(sched: Scheduler, device: FakeDevice, order: dict[str, int]) -> int:
    """Returns how many SINK entries the page tables hold."""
    cfg, alloc, kvm = sched.config, sched.allocator, sched.kv_cache_manager
    holders, num_sinks = [0] * cfg.num_pages, 0
    for rid, r in sched.requests.items():
        pages = kvm.page_ids(rid)
        sinks = check_sinks(sched, r, pages)
        held, num_sinks = pages[sinks:], num_sinks + sinks
        assert len(held) == len(set(held)) and SINK_PAGE not in held
        for p in held:
            holders[p] += 1
        if r.status is RequestStatus.WAITING:
            assert (r.num_computed_tokens, pages) == (0, [])
        else:
            assert r.status is RequestStatus.RUNNING
            assert len(pages) == cdiv(r.num_computed_tokens, cfg.page_size)
            assert r.num_computed_tokens < r.num_tokens < cfg.max_model_len
    for p in range(1, cfg.num_pages):
        assert alloc.ref_count(p) == holders[p]
        assert alloc.is_free(p) == (holders[p] == 0)
        h = alloc.page_hash(p)
        if h is not None:  # cached: the hash names exactly the tokens the page holds
            assert alloc.lookup(h) == p
            slots = [device.kv.get(p * cfg.page_size + i) for i in range(cfg.page_size)]
            keys, prefix = slots[-1]
            assert all(s[0] == keys and s[1] == prefix[:len(s[1])] for s in slots)
            assert len(prefix) % cfg.page_size == 0
            assert last_page_hash(prefix, cfg.page_size, keys) == h
    assert alloc.num_free_pages + alloc.num_used_pages == alloc.num_usable_pages
    assert len(sched.running) <= cfg.max_num_seqs
    everyone = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
    assert sorted(everyone, key=order.get) == everyone  # running, then waiting, by arrival
    assert set(everyone) == set(sched.requests)
    return num_sinks


@functools.lru_cache(maxsize=100_000)
def last_page_hash(prefix: tuple[int, ...], page_size: int, keys: tuple[str, ...]) -> bytes:
    """The hash of prefix's last page (remembered: a cached page is checked after every
    step, and hashing its whole prefix each time would take most of the module's time)."""
    return hash_pages(list(prefix), page_size, keys)[-1]


def check_sinks(sched: Scheduler, r: Request, pages: list[int]) -> int:
    """A page table's SINK entries are a leading run, all behind the window; returns their
    number."""
    cfg = sched.config
    sinks = next((i for i, p in enumerate(pages) if p != SINK_PAGE), len(pages))
    if not cfg.sliding_window:
        assert sinks == 0
        return 0
    assert sinks <= num_skipped_pages(r.num_computed_tokens, cfg.sliding_window,
                                      cfg.page_size)
    assert len(pages) - sinks <= sched.window_pages()
    return sinks


def check_plan(sched: Scheduler, out: SchedulerOutput, was_waiting: set[str]) -> None:
    cfg = sched.config
    assert sum(s.num_rows for s in out.scheduled) <= cfg.max_num_seqs
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        r, end = s.request, s.start + s.num_new_tokens
        k = len(s.spec_token_ids)
        assert s.num_new_tokens >= 1 and s.start == r.num_computed_tokens
        assert s.token_ids == r.all_token_ids[s.start:end - k] + s.spec_token_ids
        assert s.samples == (end - k == r.num_tokens)
        assert not k or (s.num_new_tokens == k + 1 and end < cfg.max_model_len)
        assert s.page_ids == sched.page_ids(r.request_id)
        if not cfg.num_lookahead_tokens:
            assert len(s.page_ids) == cdiv(end, cfg.page_size)
        else:  # a look-ahead (this step's, or an earlier one's past up to 4 proposals)
            most = min(end + cfg.num_lookahead_tokens + 4, cfg.max_model_len)
            assert cdiv(end, cfg.page_size) <= len(s.page_ids) <= cdiv(most, cfg.page_size)
        if r.request_id in was_waiting:  # admitted now: a hit is whole pages, never all
            assert s.start % cfg.page_size == 0 and s.start < r.num_tokens
            if r.sampling_params.prompt_logprobs is not None or not cfg.enable_prefix_caching:
                assert s.start == 0
    for r in out.preempted:
        assert r in sched.waiting and r not in [s.request for s in out.scheduled]


class Workload:
    """Prompts that share prefixes the way chat traffic does."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.system = [[rng.randrange(3, 50) for _ in range(rng.randint(4, 20))]
                       for _ in range(3)]
        self.histories: list[list[int]] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 50) for _ in range(n)]

    def prompt(self) -> list[int]:
        rng, kind = self.rng, self.rng.random()
        if kind < 0.35 and self.histories:  # the next turn of a conversation
            prompt = rng.choice(self.histories) + self.tokens(rng.randint(1, 6))
        elif kind < 0.8:  # a shared system prompt
            prompt = rng.choice(self.system) + self.tokens(rng.randint(1, 12))
        else:
            prompt = self.tokens(rng.randint(1, 30))
        return prompt[:rng.randint(30, 40)]

    def finished(self, req: Request) -> None:
        if len(self.histories) > 20:
            self.histories.pop(self.rng.randrange(len(self.histories)))
        self.histories.append(req.all_token_ids)


def verified(rng: random.Random, s) -> list[int]:
    """What a verifying step might emit: a prefix of the proposal, then a token of its own
    (which may equal the next proposed token: a rejection emits a different one)."""
    accepted = rng.randint(0, len(s.spec_token_ids))
    bonus = rng.randrange(50)
    if accepted < len(s.spec_token_ids) and bonus == s.spec_token_ids[accepted]:
        bonus = (bonus + 1) % 50
    return s.spec_token_ids[:accepted] + [bonus]


def propose(rng: random.Random, sched: Scheduler) -> None:
    """Random proposals (at times copied from the request's own tokens) for some requests."""
    for r in sched.running:
        if rng.random() < 0.6:
            k = rng.randint(1, 4)
            tokens = r.all_token_ids
            r.spec_token_ids = (tokens[-k:] if rng.random() < 0.5
                                else [rng.randrange(50) for _ in range(k)])


def run_scenario(seed: int, num_ops: int, speculate: bool = False,
                 window: int = 0) -> Scheduler:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 8])
    cfg = SchedulerConfig(max_num_seqs=rng.choice([2, 4, 8]),
                          max_num_batched_tokens=rng.choice([8, 16, 40]), max_model_len=48,
                          page_size=page_size,
                          num_pages=1 + rng.choice([48, 64, 128]) // page_size,
                          long_prefill_token_threshold=rng.choice([0, 0, 5]),
                          enable_prefix_caching=seed % 4 != 3, model_key=f"model-{seed}",
                          sliding_window=window,
                          # MTP's chained guesses take pages past a sampling step's tokens
                          num_lookahead_tokens=rng.choice([0, 3]) if speculate else 0)
    sched, work = Scheduler(cfg), Workload(rng)
    device = FakeDevice(sched)
    order, expected = {}, {}
    stats = dict(finished=0, sinks=0)

    def add(rid: str, prompt: list[int], params: SamplingParams) -> None:
        req = Request(rid, prompt, params, eos_token_ids=frozenset({EOS}))
        sched.add_request(req)
        order[rid], expected[rid] = len(order), []

    def random_step() -> None:
        was_waiting = {r.request_id for r in sched.waiting}
        out = sched.schedule()
        check_plan(sched, out, was_waiting)
        device.run(out)
        sampled = [(verified(rng, s) if s.spec_token_ids else rng.randrange(50))
                   if s.samples else None for s in out.scheduled]
        if out.scheduled and rng.random() < 0.05:  # an abort between dispatch and update
            sched.abort(rng.choice(out.scheduled).request.request_id)
        live = {id(s.request) for s in out.scheduled if not s.request.is_finished}
        changed = sched.update(out, sampled)
        for s, tok in zip(out.scheduled, sampled):
            if s.samples and id(s.request) in live:
                got, r = expected[s.request.request_id], s.request
                got += tok if isinstance(tok, list) else [tok]
                del got[len(r.output_token_ids):]  # a stop among the verified tokens
        for r in changed:
            assert r.output_token_ids == expected[r.request_id]
            if r.is_finished:
                assert sched.page_ids(r.request_id) == []
                work.finished(r)
                stats["finished"] += 1
        stats["sinks"] = max(stats["sinks"], check_books(sched, device, order))
        if speculate:
            propose(rng, sched)

    for i in range(num_ops):
        op = rng.random()
        if op < 0.22:
            params = dict(max_tokens=rng.choice([None, 1, 5, 20]),
                          stop_token_ids=rng.choice([[], [1]]), ignore_eos=rng.random() < 0.2,
                          cache_salt=rng.choice([None, None, None, "tenant-a", "tenant-b"]),
                          prompt_logprobs=1 if rng.random() < 0.05 else None)
            prompt = work.prompt()
            n = rng.choice([1, 1, 1, 1, 2, 3])  # n samples: requests that share a prompt
            for j in range(n):
                add(f"r{i}-{j}", prompt, SamplingParams(**params))
            check_books(sched, device, order)
        elif op < 0.27 and sched.requests:
            sched.abort(rng.choice(sorted(sched.requests)))
            check_books(sched, device, order)
        else:
            random_step()

    for _ in range(20_000):  # every request finishes: no livelock
        if not sched.has_unfinished:
            break
        random_step()
    assert not sched.has_unfinished and sched.requests == {}
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert all(sched.allocator.ref_count(p) == 0 for p in range(cfg.num_pages))
    assert stats["finished"] > 100
    assert (stats["sinks"] > 0) == (window > 0)  # a window gives pages back on the way
    return sched


# Operations per scenario: at this many the even seeds still preempt, caching ones hit,
# finishes over 100 requests and drafts over 100 times (the least: 206 drafts, seed 2).
OPS = 1000


@pytest.mark.parametrize("seed", range(16))
def test_random_schedules_keep_the_books_straight(seed):
    sched = run_scenario(seed, OPS)
    kvm = sched.kv_cache_manager
    assert sched.num_preemptions_total > 0 or seed % 2  # the small caches preempt
    if sched.config.enable_prefix_caching:
        assert 0 < kvm.prefix_cache_hits < kvm.prefix_cache_queries
        assert sched.allocator.num_cached_pages > 0
    else:
        assert kvm.prefix_cache_hits == kvm.prefix_cache_queries == 0
        assert sched.allocator.num_cached_pages == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_with_speculation_keep_the_books_straight(seed):
    sched = run_scenario(seed, OPS, speculate=True)
    stats = sched.spec_stats
    assert stats.num_drafts > 100
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# (seed, window): a one-key window, windows within a page and over several, all page sizes
WINDOW_CASES = [(0, 1), (1, 3), (2, 8), (3, 13), (4, 5), (5, 8), (6, 3), (7, 13)]


@pytest.mark.parametrize("seed,window", WINDOW_CASES)
def test_random_window_schedules_keep_the_books_straight(seed, window):
    sched = run_scenario(seed, OPS, window=window)
    kvm = sched.kv_cache_manager
    if sched.config.enable_prefix_caching:
        assert 0 < kvm.prefix_cache_hits < kvm.prefix_cache_queries


@pytest.mark.parametrize("seed,window", WINDOW_CASES[:4])
def test_random_window_schedules_with_speculation_keep_the_books_straight(seed, window):
    sched = run_scenario(seed, OPS, speculate=True, window=window)
    assert 0 < sched.spec_stats.num_accepted_tokens < sched.spec_stats.num_draft_tokens
