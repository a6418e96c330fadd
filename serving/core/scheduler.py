"""Continuous-batching scheduler: every request's num_computed_tokens catches up to num_tokens
under a token budget, over a paged KV cache, with recompute preemption. No JAX."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from serving.core.kv_cache_manager import KVCacheManager, cdiv
from serving.core.kv_hybrid import HybridKVCacheManager
from serving.core.kv_window import request_pages
from serving.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from serving.core.request_checks import RequestRefused, fit_max_tokens, fit_pooling_prompt
from serving.core.spec_decode import SpecDecodeStats, check_verified, num_drafts
from serving.core.state_slots import StateKVCacheManager, StateSlots


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_pages: int  # including the sink page 0
    long_prefill_token_threshold: int = 0  # cap on one prefill chunk; 0: only the budget caps it
    enable_prefix_caching: bool = True
    model_key: str = ""  # names the weights in page hashes
    # LoRA: the most distinct adapters running at once (the device's slots); 0: LoRA off
    max_loras: int = 0
    # The window every layer attends within (core/kv_window.py: common_window); 0: some
    # layer attends fully. Above 0, pages behind the window go back as a request advances.
    sliding_window: int = 0
    # A hybrid model (model/kv_groups.py): its window layers' window, and the pages
    # (sink included) of their own pool; 0: one page table for every layer.
    window_group: int = 0
    window_num_pages: int = 0
    # Positions past a sampling step's tokens that get pages with it (MTP's chained guesses
    # write their latents there: serving/engine/mtp_drafter.py); 0: none
    num_lookahead_tokens: int = 0
    # A linear-attention hybrid (core/state_slots.py): the recurrent state slots running
    # requests hold, one each; 0: no linear layer.
    state_slots: int = 0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {self.num_pages}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.sliding_window < 0:
            raise ValueError("sliding_window must be >= 0")
        if self.window_group and self.sliding_window:
            raise ValueError("window_group (a hybrid model's window layers) and "
                             "sliding_window (every layer's) exclude each other")
        if self.window_group:
            need = request_pages(self.window_group, self.max_num_batched_tokens,
                                 self.page_size)
            if self.window_num_pages < need + 1:
                raise ValueError(f"the window layers' pool needs at least {need + 1} pages "
                                 f"(one request's window and step), got "
                                 f"{self.window_num_pages}")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # query tokens this step, proposed ones included
    start: int  # position of the first new token (= num_computed_tokens when scheduled)
    # all_token_ids[start:] up to the last known token, then spec_token_ids
    token_ids: list[int]
    samples: bool  # the chunk ends at the last known token: its sampled token is a real output
    page_ids: list[int] = field(default_factory=list)  # snapshot of the request's page table
    # A hybrid model's window layers' page table (core/kv_hybrid.py); None: one table
    window_page_ids: list[int] | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # proposed tokens it verifies
    state_slot: int | None = None  # a linear-attention hybrid's state slot (core/state_slots.py)

    @property
    def num_rows(self) -> int:
        """Sampled rows: one per proposed token, and one after them (the bonus token)."""
        return 1 + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Running requests first (in arrival order), then waiting ones FCFS. A request that needs
    a page when none is free preempts the newest running request, which later recomputes."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        if config.window_group:
            self.kv_cache_manager = HybridKVCacheManager(
                config.num_pages, config.window_num_pages, config.page_size,
                config.window_group, config.enable_prefix_caching, config.model_key)
        else:
            self.kv_cache_manager = KVCacheManager(
                config.num_pages, config.page_size, config.enable_prefix_caching,
                config.model_key, config.sliding_window)
        if config.state_slots:
            self.kv_cache_manager = StateKVCacheManager(self.kv_cache_manager,
                                                        StateSlots(config.state_slots))
        self.allocator = self.kv_cache_manager.allocator
        self.waiting: deque[Request] = deque()
        # Admission is FCFS and preemption takes the newest, so every running request arrived
        # before every waiting one and appending on admission keeps `running` in arrival order.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_preemptions_total = 0
        self.num_prompt_tokens_total = 0  # prompt tokens computed (not those found cached)
        self.num_generation_tokens_total = 0
        self.spec_stats = SpecDecodeStats()
        # Prefill/decode disaggregation (serving/kv_transfer/): requests holding pages that
        # another instance's K/V is being pulled into, out of the queue meanwhile; the loads
        # schedule() started, for the connector; its hook, before a finished request's pages
        # are freed.
        self.loading: dict[str, Request] = {}
        self._loads: list[Request] = []
        self.on_finish = None
        self._spare_rows = 0  # sampled rows this step may still give proposed tokens
        # A request longer than the whole cache could never be scheduled again; stop it there.
        # On a window model a request holds a bounded number of pages however long it grows.
        capacity = self.allocator.num_usable_pages * config.page_size
        self._max_len = min(config.max_model_len, capacity + 1)
        if 0 < self.window_pages() <= self.allocator.num_usable_pages:
            self._max_len = config.max_model_len

    # -- requests in and out --------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self._check_fits(req)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if (req.status is not RequestStatus.WAITING or req.num_computed_tokens
                or self.kv_cache_manager.page_ids(req.request_id)):
            raise ValueError(f"request {req.request_id!r} is not a fresh request")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _check_fits(self, req: Request) -> None:
        cfg, n = self.config, req.num_prompt_tokens
        if req.pooling_params is not None:  # an embedding: the prompt alone
            fit_pooling_prompt(n, cfg.max_model_len, prompt_param="prompt")
        else:
            fit_max_tokens(n, None, cfg.max_model_len)
        pages = cdiv(n + (req.pooling_params is None), cfg.page_size)
        if self.window_pages():
            pages = min(pages, self.window_pages())
        if pages > self.allocator.num_usable_pages:
            raise RequestRefused(f"the prompt has {n} tokens and needs {pages} KV cache pages "
                                 f"of {cfg.page_size} tokens, but the cache has only "
                                 f"{self.allocator.num_usable_pages}", param="prompt")

    def window_pages(self) -> int:
        """On a window model, the most pages one request holds at once (0: no window)."""
        cfg = self.config
        return request_pages(cfg.sliding_window, cfg.max_num_batched_tokens, cfg.page_size)

    def finish_request(self, request_id: str, status: RequestStatus,
                       reason: int | str | None = None) -> None:
        """Stops a request now (stop string, abort) and frees its pages. Unknown or already
        finished ids are ignored: an abort may race with the request finishing."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif self.loading.pop(request_id, None) is None:
            self.waiting.remove(req)
        self._finish(req, status, reason)

    def stop_on_string(self, req: Request, stop: str, num_output_tokens: int | None = None
                       ) -> None:
        """A stop string completed in the request's text. It ends the request with "stop",
        also when the same token ended it another way (max_tokens, EOS): the text ends at the
        stop string, so that is what is reported, as vLLM does. num_output_tokens: the
        outputs up to the one that completed it; a verifying step's later ones are dropped."""
        if num_output_tokens is not None:
            del req.output_token_ids[num_output_tokens:]
        if req.request_id in self.requests:
            self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop)
        elif req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            req.status, req.finish_reason, req.stop_reason = (
                RequestStatus.FINISHED_STOPPED, "stop", stop)

    def abort(self, request_id: str) -> None:
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus, reason: int | str | None) -> None:
        req.status, req.finish_reason, req.stop_reason = status, status.finish_reason, reason
        if self.on_finish is not None:
            self.on_finish(req)
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # A step samples at most max_num_seqs rows; every request takes one, proposed
        # tokens take the rest.
        self._spare_rows = self.config.max_num_seqs - len(self.running)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # Pages just taken from a preempted request should go to the older running ones, not
        # straight back to it as a fresh prefill (vLLM v1 does the same).
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            k = (num_drafts(req, n, budget, self._spare_rows, self._max_len)
                 if req.spec_token_ids else 0)
            ahead = self._lookahead(req, n + k)
            while not self.kv_cache_manager.allocate_slots(req, n + k + ahead):
                if ahead:  # short of pages: no look-ahead, then verify nothing, then preempt
                    ahead = 0
                    continue
                if k:
                    k = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    return budget  # it was the newest, so nothing after it is left to schedule
            out.scheduled.append(self._scheduled(req, n, req.spec_token_ids[:k] if k else ()))
            self._spare_rows -= k
            budget -= n + k
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs - self._used_rows(out)):
            req = self.waiting[0]
            if not self._adapter_fits(req):
                break  # FCFS: it waits for a running adapter's requests to finish
            if req.remote_tokens:  # its first pages come from another instance
                if not self.kv_cache_manager.allocate_slots(req, req.remote_tokens):
                    break
                self.loading[self.waiting.popleft().request_id] = req
                self._loads.append(req)
                continue
            # A request holding pages here has its first tokens' K/V loaded (finish_load).
            loaded = bool(self.kv_cache_manager.page_ids(req.request_id))
            hit = [] if loaded else self.kv_cache_manager.get_computed_pages(req)
            if not loaded:
                req.num_computed_tokens = len(hit) * self.config.page_size
            n = self._num_new_tokens(req, budget)
            ahead = self._lookahead(req, n)
            if not (self.kv_cache_manager.allocate_slots(req, n + ahead, hit) or ahead and
                    self.kv_cache_manager.allocate_slots(req, n, hit)):
                if not loaded:
                    req.num_computed_tokens = 0
                break  # strict FCFS: later requests do not overtake the head of the queue
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n

    def take_loads(self) -> list[Request]:
        """The requests whose pages schedule() allocated for another instance's K/V."""
        loads, self._loads = self._loads, []
        return loads

    def finish_load(self, req: Request, loaded: bool) -> None:
        """A load ended: with its K/V in the pages (those tokens count as computed and are
        cached), or not (the pages go back and the prompt is computed here). Either way the
        request goes to the head of the queue. Ignored for a request aborted meanwhile."""
        if self.loading.pop(req.request_id, None) is None:
            return
        if loaded:
            req.num_computed_tokens = req.remote_tokens
            self.kv_cache_manager.cache_computed(req)
        else:
            self.kv_cache_manager.free(req)
        req.remote_tokens = 0
        self.waiting.appendleft(req)

    def _adapter_fits(self, req: Request) -> bool:
        """Running requests use at most max_loras distinct adapters, so every step's
        adapters fit the device's slots (vLLM admits the same way)."""
        if req.lora_key is None or not self.config.max_loras:
            return True
        running = {r.lora_key for r in self.running} - {None}
        return req.lora_key in running or len(running) < self.config.max_loras

    @staticmethod
    def _used_rows(out: SchedulerOutput) -> int:
        return sum(len(s.spec_token_ids) for s in out.scheduled)

    def _drop_lookahead(self, req: Request) -> None:
        """After the step: its look-ahead pages go back (the next step takes its own), so
        between steps a request holds the pages of its computed tokens alone."""
        if self.config.num_lookahead_tokens:
            self.kv_cache_manager.trim(req)

    def _lookahead(self, req: Request, n: int) -> int:
        """The look-ahead positions a step of n tokens for req also takes pages for: only
        where the step samples, and never past the longest sequence."""
        end = req.num_computed_tokens + n
        if not self.config.num_lookahead_tokens or end < req.num_tokens:
            return 0
        return max(0, min(self.config.num_lookahead_tokens, self._max_len - end))

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)  # its cached pages stay findable: recompute may hit
        req.num_computed_tokens = 0  # its output tokens stay; prefill recomputes them
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)  # it arrived before everything still waiting
        out.preempted.append(req)

    def _scheduled(self, req: Request, n: int, spec: list[int] = ()) -> ScheduledRequest:
        start = req.num_computed_tokens
        if req.spec_token_ids:
            req.spec_token_ids = []  # used (or dropped) now: the next step proposes afresh
        kvm = self.kv_cache_manager
        window = (list(kvm.window_page_ids(req.request_id)) if self.config.window_group
                  else None)
        tokens = req.slice_token_ids(start, start + n)
        return ScheduledRequest(req, n + len(spec), start, tokens + spec if spec else tokens,
                                start + n == req.num_tokens, list(kvm.page_ids(req.request_id)),
                                window, list(spec),
                                kvm.state_slot(req.request_id) if self.config.state_slots
                                else None)

    # -- update -----------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: list) -> list[Request]:
        """Applies one step's results. sampled[i] belongs to output.scheduled[i] and is ignored
        for non-final prefill chunks; for a request verifying proposed tokens it is the list of
        tokens the step emitted (accepted proposed ones, then the target's). Returns the
        requests that got a token, finished or not."""
        if len(sampled) != len(output.scheduled):
            raise ValueError(f"{len(sampled)} sampled tokens for "
                             f"{len(output.scheduled)} scheduled requests")
        changed = []
        for sr, token in zip(output.scheduled, sampled):
            req = sr.request
            if not self._applies(sr):
                continue
            if sr.spec_token_ids:
                self._update_verified(sr, list(token))
                changed.append(req)
                continue
            req.num_computed_tokens += sr.num_new_tokens
            self.kv_cache_manager.cache_computed(req)
            if not sr.samples:
                continue
            self._drop_lookahead(req)
            if req.pooling_params is not None:  # its prompt is computed: done, no token
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_STOPPED, None)
                changed.append(req)
                continue
            if token is None:
                raise ValueError(f"request {req.request_id!r} samples this step but got None")
            self._append_token(req, int(token))
            changed.append(req)
        return changed

    # -- async scheduling (engine/step_ahead.py) ----------------------------------------------

    def update_ahead(self, output: SchedulerOutput) -> list[tuple[Request, int]]:
        """Applies a step still running on the device as far as it can be without its
        tokens, so the next step can be scheduled now: its tokens count as computed, and
        each request it samples for gets PLACEHOLDER_TOKEN as its next output, with the stops
        that do not depend on the token (max_tokens, the model's length). Returns (request,
        index of its placeholder) per sampling request, for `resolve`. Only for steps with no
        proposed tokens, grammars or penalties (step_ahead.runs_ahead)."""
        ahead = []
        for sr in output.scheduled:
            req = sr.request
            if not self._applies(sr):
                continue
            req.num_computed_tokens += sr.num_new_tokens
            self.kv_cache_manager.cache_computed(req)
            if not sr.samples:
                continue
            self._drop_lookahead(req)
            ahead.append((req, req.num_output_tokens))
            req.output_token_ids.append(PLACEHOLDER_TOKEN)
            self.num_generation_tokens_total += 1
            if self._at_length(req):
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH, None)
        return ahead

    def resolve(self, ahead: list[tuple[Request, int]], tokens: list[int]) -> list[Request]:
        """Writes the tokens of a step applied by update_ahead and applies the stops that
        depend on them (EOS, stop token ids), one step late: a request that stopped here
        and was scheduled again meanwhile is skipped when that step is applied. A request
        ended at max_tokens ahead whose last token is EOS or a stop token ends with "stop",
        as it would have without running ahead. Returns the requests that got a token."""
        changed = []
        for (req, index), token in zip(ahead, tokens):
            if (index >= req.num_output_tokens
                    or req.output_token_ids[index] != PLACEHOLDER_TOKEN):
                continue  # cut off since (a stop string in an earlier token)
            req.output_token_ids[index] = token
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            changed.append(req)
            if req.status is RequestStatus.FINISHED_ABORTED:
                continue
            stop = self._check_stop(req, token)
            if stop is None:
                continue
            if req.is_finished:  # ended at max_tokens ahead: the token may make it a stop
                req.status, req.finish_reason, req.stop_reason = (
                    stop[0], stop[0].finish_reason, stop[1])
            else:
                self.finish_request(req.request_id, *stop)
        return changed

    def _update_verified(self, sr: ScheduledRequest, tokens: list[int]) -> None:
        """Only the accepted positions' K/V count as computed; pages holding nothing but
        rejected ones go back before any page is cached, so no rejected token is ever
        findable, and the next step overwrites the rejected slots it keeps."""
        req = sr.request
        accepted = check_verified(sr.spec_token_ids, tokens)
        self.spec_stats.observe(len(sr.spec_token_ids), accepted)
        req.num_computed_tokens += sr.num_new_tokens - (len(sr.spec_token_ids) - accepted)
        self.kv_cache_manager.trim(req)
        for token in tokens:
            self._append_token(req, int(token))
            if req.is_finished:
                return
        self.kv_cache_manager.cache_computed(req)

    def _append_token(self, req: Request, token: int) -> None:
        req.output_token_ids.append(token)
        self.num_generation_tokens_total += 1
        if req.grammar is not None:
            req.grammar.accept(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        stop = self._check_stop(req, token)
        if stop is not None:
            self.running.remove(req)
            self._finish(req, *stop)

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus, int | None] | None:
        params = req.sampling_params
        if req.num_output_tokens > params.min_tokens:  # min_tokens: no EOS or stop token yet
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
            if token in req.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None  # vLLM: stop_reason None means EOS
        # A complete grammar ends the request, also at max_tokens: the output is whole.
        if req.grammar is not None and req.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED, None
        if self._at_length(req):
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def _at_length(self, req: Request) -> bool:
        return req.num_output_tokens >= req.max_tokens or req.num_tokens >= self._max_len

    def _applies(self, sr: ScheduledRequest) -> bool:
        """Whether a scheduled request's step still applies (not aborted, nor preempted by
        a later schedule(), since); if so its prompt tokens are counted."""
        req = sr.request
        if req.status is not RequestStatus.RUNNING or req.num_computed_tokens != sr.start:
            return False
        if sr.start < req.num_prompt_tokens:  # a prefill chunk
            self.num_prompt_tokens_total += min(req.num_prompt_tokens - sr.start,
                                                sr.num_new_tokens)
        return True

    # -- introspection ----------------------------------------------------------------------

    @property
    def max_len(self) -> int:
        """The longest a request may grow: max_model_len, or what the whole cache holds
        (unless the window bounds the pages a request holds)."""
        return self._max_len

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def page_ids(self, request_id: str) -> list[int]:
        return self.kv_cache_manager.page_ids(request_id)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)
