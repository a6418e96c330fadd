"""Prometheus metrics with vLLM's names under the `xlaserve:` prefix, and every one of them
again under `vllm:` (serving/openai/metric_aliases.py), so the routers, autoscalers and
dashboards built for vLLM read a worker unchanged.

Each `Metrics` owns its own CollectorRegistry, so several servers in one process (tests) do
not collide in prometheus_client's global registry. Every series carries a `model_name`
label as vLLM's do, and what an engine reports its `engine` (data-parallel rank).
"""
from __future__ import annotations

import time

from serving.openai.metric_aliases import vllm_aliases
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

PREFIX = "xlaserve:"

# Buckets as vLLM's (seconds): TTFT and ITL are short, whole requests long.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        # What each engine (data-parallel replica) reports, labelled with its rank as vLLM's
        # series are (`engine`).
        per_engine = ["model_name", "engine"]
        self._running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch.",
                              per_engine, registry=self.registry)
        self._waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to run.",
                              per_engine, registry=self.registry)
        self._kv_usage = Gauge(PREFIX + "kv_cache_usage_perc",
                               "Fraction of KV cache pages in use (0 to 1).", per_engine,
                               registry=self.registry)
        self._preemptions = Counter(PREFIX + "num_preemptions_total", "Preempted requests.",
                                    per_engine, registry=self.registry)
        self._prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                       "Prompt tokens looked up in the prefix cache.",
                                       per_engine, registry=self.registry)
        self._prefix_hits = Counter(PREFIX + "prefix_cache_hits",
                                    "Prompt tokens found in the prefix cache.", per_engine,
                                    registry=self.registry)
        # vLLM's cache_config_info: value 1, the KV cache's facts as labels (llm-d reads
        # block_size and num_gpu_blocks)
        self._cache_info = Gauge(PREFIX + "cache_config_info", "Information of the KV cache.",
                                 ["model_name", "engine", "block_size", "num_gpu_blocks",
                                  "cache_dtype", "enable_prefix_caching"],
                                 registry=self.registry)
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed.")
        # computed here, or K/V pulled from a prefill instance (serving/kv_transfer/)
        self._prompt_sources = Counter(PREFIX + "prompt_tokens_by_source",
                                       "Prompt tokens by where their K/V came from.",
                                       ["model_name", "source"], registry=self.registry)
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.spec_num_drafts = counter(
            "spec_decode_num_drafts", "Request-steps that verified proposed tokens.")
        self.spec_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self._spec_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by position in the proposal.",
                                     ["model_name", "position"], registry=self.registry)
        self._success = Counter(PREFIX + "request_success_total",
                                "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from arrival to the first output token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive outputs of a request.", ITL_BUCKETS)
        # vLLM's older name for the same samples; dashboards still query it.
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time between consecutive outputs (older name).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the last output.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled.",
                                    REQUEST_BUCKETS)
        # vLLM's LoRA gauge (the Gateway API inference extension reads it): the time of the
        # last update, labelled with the adapters running and waiting and the slot count
        self._lora_info = Gauge(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                                registry=self.registry)
        self._seen: dict[str, int] = {}  # engine running totals already counted
        self._aliases = vllm_aliases(self.registry)

    # -- called by the server -------------------------------------------------------------

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_token(self, itl_s: float | None, num_tokens: int = 1) -> None:
        """One output update carrying num_tokens new tokens; itl_s is the gap since the
        previous update (None for the first)."""
        if num_tokens > 0:
            self.generation_tokens.inc(num_tokens)
        if itl_s is not None:
            self.itl.observe(itl_s)
            self.tpot.observe(itl_s)

    def observe_request_finished(self, finished_reason: str, e2e_s: float,
                                 queue_s: float | None = None) -> None:
        self._success.labels(self.model_name, finished_reason).inc()
        self.e2e.observe(e2e_s)
        if queue_s is not None:
            self.queue_time.observe(queue_s)

    def set_engine_stats(self, running: int, waiting: int, kv_usage: float,
                         preemptions_total: int, prefix_cache_queries: int = 0,
                         prefix_cache_hits: int = 0, engine: int = 0) -> None:
        """One engine's (data-parallel replica's) state and running totals."""
        labels = (self.model_name, str(engine))
        self._running.labels(*labels).set(running)
        self._waiting.labels(*labels).set(waiting)
        self._kv_usage.labels(*labels).set(kv_usage)
        self._advance(self._preemptions.labels(*labels), f"preemptions_{engine}",
                      preemptions_total)
        self._advance(self._prefix_queries.labels(*labels), f"queries_{engine}",
                      prefix_cache_queries)
        self._advance(self._prefix_hits.labels(*labels), f"hits_{engine}", prefix_cache_hits)

    def set_prompt_token_sources(self, computed: int, transferred: int) -> None:
        """Running totals: prompt tokens computed here, and pulled from another instance."""
        for source, total in (("local_compute", computed), ("external_kv_transfer", transferred)):
            self._advance(self._prompt_sources.labels(self.model_name, source),
                          f"prompt_{source}", total)

    def set_cache_config(self, page_size: int, num_pages: int, cache_dtype: str,
                         enable_prefix_caching: bool, engine: int = 0) -> None:
        self._cache_info.labels(self.model_name, str(engine), str(page_size), str(num_pages),
                                cache_dtype, str(enable_prefix_caching)).set(1)

    def set_lora_stats(self, running: dict[str, int] | None, waiting: dict[str, int] | None,
                       max_lora: int) -> None:
        """Adapter name -> request count, running and waiting (None: LoRA is off). Only the
        latest label set is kept."""
        if running is None:
            return
        self._lora_info.clear()
        self._lora_info.labels(",".join(sorted(running)), ",".join(sorted(waiting or {})),
                               str(max_lora)).set_to_current_time()

    def set_spec_decode_stats(self, spec) -> None:
        """spec: the engine's SpecDecodeStats running totals (None: speculation is off)."""
        if spec is None:
            return
        self._advance(self.spec_num_drafts, "spec_drafts", spec.num_drafts)
        self._advance(self.spec_num_draft_tokens, "spec_draft_tokens", spec.num_draft_tokens)
        self._advance(self.spec_num_accepted_tokens, "spec_accepted", spec.num_accepted_tokens)
        for pos, total in enumerate(spec.accepted_per_pos):
            self._advance(self._spec_per_pos.labels(self.model_name, str(pos)),
                          f"spec_pos_{pos}", total)

    def _advance(self, counter, name: str, total: int) -> None:
        """The engine reports running totals; a Prometheus counter only moves forward."""
        seen = self._seen.get(name, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self._aliases)

    def track(self, num_prompt_tokens: int, arrival: float | None = None) -> "RequestTracker":
        return RequestTracker(self, num_prompt_tokens, arrival)


class RequestTracker:
    """Timing of one engine request, fed with each output update."""

    def __init__(self, metrics: Metrics, num_prompt_tokens: int, arrival: float | None = None):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic() if arrival is None else arrival
        self.last: float | None = None
        self.done = False
        self.num_generated = 0  # output tokens so far (the access log reports them)

    def on_output(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        self.num_generated += num_new_tokens
        now = time.monotonic()
        if self.last is None:
            self.metrics.observe_first_token(now - self.arrival, self.num_prompt_tokens)
            self.metrics.observe_token(None, num_new_tokens)
        else:
            self.metrics.observe_token(now - self.last, num_new_tokens)
        self.last = now

    def on_finish(self, finished_reason: str | None, queue_s: float | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.observe_request_finished(finished_reason or "abort",
                                              time.monotonic() - self.arrival, queue_s)
