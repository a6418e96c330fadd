"""JaxTransferConnector: prefill/decode disaggregation over `jax.experimental.transfer`
(docs/architecture.md, "Prefill/decode disaggregation"). Everything here but the pull runs
on the engine thread; a pull runs on a thread of its own, under a deadline of ours (the
library's own timeout does not fire), and never blocks the engine.

Producer (kv_producer, kv_both): a request with `do_remote_decode` that finishes keeps a
reference on its prompt's full pages (all but the last token's: the decode side computes
that one for its logits); they are gathered into arrays, offered with `await_pull`, and the
response carries the offer (params.py). The pages go back when the decode side's claim ends
(side_channel.py), or after `offer_timeout_s` if nobody claims them.

Consumer (kv_consumer, kv_both): a request with `do_remote_prefill` whose offer fits (same
tokens, weights and page layout) waits outside the batch while the scheduler allocates its
pages and this connector pulls them; it then joins with those tokens computed, so only the
tail is prefilled here. Anything that goes wrong (a refused or unreachable producer, a
failed or late pull) frees the pages and the request is prefilled here from scratch.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass

import jax
from jax.experimental import transfer

from serving.core.request import Request, RequestStatus
from serving.kv_transfer import pages, side_channel
from serving.kv_transfer.config import KVTransferConfig
from serving.kv_transfer.params import (Offer, token_digest, wants_remote_decode,
                                        wants_remote_prefill)

log = logging.getLogger("xlaserve")


@dataclass
class _Held:
    """One offer of this producer: the pages kept, the arrays offered."""
    page_ids: list[int]
    arrays: dict
    deadline: float  # for a claim; once claimed, the claim's connection decides
    claimed: bool = False


@dataclass
class _Load:
    """One pull of this consumer."""
    req: Request
    offer: Offer
    deadline: float
    result: object = None  # the pulled arrays, or the exception that ended the pull
    seconds: float = 0.0  # claim to arrival


def check_engine(engine) -> None:
    """What the connector does not handle, refused at start-up."""
    sc = engine.scheduler.config
    for refused, what in ((engine.placement.size > 1, "tensor parallelism"),
                          (engine.cluster is not None, "several processes"),
                          (sc.sliding_window or sc.window_group, "sliding-window models"),
                          (engine.draft is not None, "a draft model"),
                          (engine.task != "generate", f"--task {engine.task}")):
        if refused:
            raise ValueError(f"--kv-transfer-config does not support {what} yet")


class JaxTransferConnector:
    def __init__(self, config: KVTransferConfig, engine):
        check_engine(engine)
        self.config = config
        self.scheduler, self.runner = engine.scheduler, engine.runner
        self.kvm = self.scheduler.kv_cache_manager
        self.page_size = self.scheduler.config.page_size
        self.device = self.runner.placement.devices[0]
        self._layout: list | None = None
        self.wake = lambda: None  # set by the engine loop: a pull landed, a claim ended
        self._lock = threading.Lock()  # guards the offers and what threads hand over
        self._offers: dict[int, _Held] = {}  # transfer id -> offer (producer)
        self._released: deque[int] = deque()  # claims ended, pages to free
        self._incoming: dict[str, Offer] = {}  # request id -> the offer it pulls (consumer)
        self._loads: dict[str, _Load] = {}  # request id -> its pull in flight
        self._landed: deque[_Load] = deque()
        self.num_transferred_tokens = 0  # prompt tokens pulled instead of computed
        # A consumer alone is never pulled from: any free port.
        port = config.kv_port if config.is_producer else 0
        self.server = transfer.start_transfer_server(
            self.device.client, f"{config.kv_ip}:{port}", [f"{config.kv_ip}:0"] * 2)
        self.host = config.extra("advertise_host") or config.kv_ip
        self.side_channel = None
        if config.is_producer:
            self.side_channel = side_channel.SideChannelServer(
                config.kv_ip, config.side_channel_port, self._claim, self._release,
                float(config.extra("offer_timeout_s")))
            self.scheduler.on_finish = self.on_finish
        log.info("kv transfer: %s %s, transfer server %s%s", config.kv_connector,
                 config.kv_role, self.server.address(),
                 f", side channel port {self.side_channel.port}" if self.side_channel else "")

    @property
    def layout(self) -> list:
        if self._layout is None:
            self._layout = pages.layout(self.runner.cache)
        return self._layout

    @property
    def transfer_port(self) -> int:
        return int(self.server.address().rsplit(":", 1)[1])

    # -- producer ---------------------------------------------------------------------------

    def on_finish(self, req: Request) -> None:
        """The scheduler's hook, before a finished request's pages are freed: a prefill for
        another instance keeps and offers them."""
        params = req.sampling_params.kv_transfer_params
        if req.status is RequestStatus.FINISHED_ABORTED or not wants_remote_decode(params):
            return
        n = (req.num_prompt_tokens - 1) // self.page_size
        page_ids = list(self.kvm.page_ids(req.request_id)[:n])
        transfer_id = secrets.randbits(50)
        offer = Offer(transfer_id, self.host, self.transfer_port, self.side_channel.port, n,
                      n * self.page_size, self._digest(req, n), self.layout)
        if n:
            self.kvm.allocator.incref(page_ids)
            arrays = pages.gather(self.runner.cache, page_ids)
            self.server.await_pull(transfer_id, arrays)
            deadline = time.monotonic() + float(self.config.extra("offer_timeout_s"))
            with self._lock:
                self._offers[transfer_id] = _Held(page_ids, arrays, deadline)
        req.kv_transfer_params = offer.answer(req.request_id, self.config.engine_id, page_ids)

    def _claim(self, transfer_id: int) -> bool:  # the side channel's thread
        with self._lock:
            held = self._offers.get(transfer_id)
            if held is None or held.claimed or time.monotonic() > held.deadline:
                return False
            held.claimed = True
            return True

    def _release(self, transfer_id: int) -> None:  # the side channel's thread
        with self._lock:
            self._released.append(transfer_id)
        self.wake()

    def _free_offers(self, now: float) -> None:
        with self._lock:
            done = [self._offers.pop(t) for t in self._released if t in self._offers]
            self._released.clear()
            expired = [t for t, h in self._offers.items() if not h.claimed and now > h.deadline]
            done += [self._offers.pop(t) for t in expired]
        for held in done:
            self.kvm.allocator.free(reversed(held.page_ids))
        if expired:
            log.warning("kv transfer: %d offer(s) never claimed, freed", len(expired))

    # -- consumer ---------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Before the scheduler has it: marks a decode request whose offer fits for loading
        (the scheduler then allocates its pages; `start_loads` pulls them)."""
        params = req.sampling_params.kv_transfer_params
        if not (self.config.is_consumer and wants_remote_prefill(params)):
            return
        try:
            offer = Offer.from_params(params)
            self._check(req, offer)
        except ValueError as e:
            log.warning("request %s: prefilling here, the transferred KV cannot be used: %s",
                        req.request_id, e)
            return
        if offer.num_pages:
            req.remote_tokens = offer.num_tokens
            self._incoming[req.request_id] = offer

    def _check(self, req: Request, offer: Offer) -> None:
        if offer.layout != self.layout:
            raise ValueError(f"the pages' layout {offer.layout} is not this cache's "
                             f"{self.layout}")
        if offer.num_tokens != offer.num_pages * self.page_size:
            raise ValueError(f"{offer.num_pages} pages cannot hold {offer.num_tokens} tokens "
                             f"of {self.page_size} a page")
        if offer.num_tokens >= req.num_prompt_tokens:
            raise ValueError("the pages cover the whole prompt; its last token is computed here")
        if req.sampling_params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need every prompt token computed here")
        if offer.token_digest != self._digest(req, offer.num_pages):
            raise ValueError("the pages hold other tokens, or K/V of other weights")

    def _digest(self, req: Request, num_pages: int) -> str:
        tokens = req.prompt_token_ids[:num_pages * self.page_size]
        return token_digest(tokens, self.kvm.extra_keys(req))

    def start_loads(self) -> None:
        """Pulls the pages the scheduler just allocated, each on a thread of its own."""
        deadline = time.monotonic() + float(self.config.extra("pull_timeout_s"))
        for req in self.scheduler.take_loads():
            offer = self._incoming.pop(req.request_id)
            load = self._loads[req.request_id] = _Load(req, offer, deadline)
            threading.Thread(target=self._pull, args=(load,), name="xlaserve-kv-pull",
                             daemon=True).start()

    def _pull(self, load: _Load) -> None:  # a thread of its own
        offer, started = load.offer, time.perf_counter()
        try:
            timeout = float(self.config.extra("pull_timeout_s"))
            sock = side_channel.claim(offer.host, offer.side_channel_port, offer.transfer_id,
                                      timeout)
            try:
                conn = self.server.connect(f"{offer.host}:{offer.port}")
                arrays = conn.pull(offer.transfer_id,
                                   pages.specs(offer.layout, offer.num_pages, self.device))
                load.result = jax.block_until_ready(arrays)
            finally:
                side_channel.release(sock)
        except Exception as e:  # noqa: BLE001 - any failure means a local prefill
            load.result = e
        load.seconds = time.perf_counter() - started
        with self._lock:
            self._landed.append(load)
        self.wake()

    def _finish_loads(self, now: float) -> None:
        with self._lock:
            landed, self._landed = list(self._landed), deque()
        for load in landed:
            rid = load.req.request_id
            if self._loads.get(rid) is not load:
                continue  # aborted, or given up on at its deadline
            del self._loads[rid]
            if isinstance(load.result, Exception):
                self._fall_back(load, f"{type(load.result).__name__}: {load.result}")
                continue
            page_ids = self.kvm.page_ids(rid)[:load.offer.num_pages]
            nbytes = sum(a.nbytes for a in load.result.values())
            log.info("kv transfer: request %s pulled %d pages (%d padded, %.2f MiB) in %.1f ms",
                     rid, len(page_ids), pages.padded_count(len(page_ids)), nbytes / 2**20,
                     load.seconds * 1e3)
            self.runner.cache = pages.scatter(self.runner.cache, page_ids, load.result)
            self.num_transferred_tokens += load.offer.num_tokens
            self.scheduler.finish_load(load.req, loaded=True)
        for rid, load in list(self._loads.items()):
            if now > load.deadline:
                del self._loads[rid]
                self._fall_back(load, "the pull did not land in time")

    def _fall_back(self, load: _Load, why: str) -> None:
        log.warning("request %s: pulling its KV failed (%s); prefilling here",
                    load.req.request_id, why)
        self.scheduler.finish_load(load.req, loaded=False)

    def forget(self, request_id: str) -> None:
        """An aborted request: its pull, if any, lands unused."""
        self._incoming.pop(request_id, None)
        self._loads.pop(request_id, None)

    # -- the engine loop --------------------------------------------------------------------

    def poll(self) -> None:
        """Applies what the threads handed over and what timed out; at each step and when
        `wait_s` says so."""
        now = time.monotonic()
        self._finish_loads(now)
        self._free_offers(now)

    def wait_s(self) -> float | None:
        """Seconds until `poll` has work (0: now); None: nothing pending but what wakes it."""
        with self._lock:
            if self._landed or self._released:
                return 0.0
            deadlines = [h.deadline for h in self._offers.values() if not h.claimed]
        deadlines += [load.deadline for load in self._loads.values()]
        return max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
