"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

    out = scheduler.schedule()               # host: who runs, how many tokens, which pages
    handle = runner.dispatch(input_batch.prepare(out))  # device: a program per bucket
    outputs = self.outputs.emit(last step)   # host: detokenize while the device works
    scheduler.update(out, runner.fetch(handle).tokens)
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import jax

from model.attention import resolve_backend
from model.checkpoint import param_bytes
from model.kv_cache import bytes_per_page
from model.mtp import is_mtp_method
from quant.recipe import describe as describe_quantization
from serving.engine import (demo_defaults, engine_setup, linear_setup, memory_plan, mesh,
                            multiprocess, sizing)
from serving.core.config import EngineConfig
from serving.core.kv_events_config import KVEventsConfig
from serving.engine.faults import Faults
from serving.engine.model_files import (eos_token_ids, load_tokenizer, load_weights, model_key,
                                        request_vocab_size)
from serving.core import grammar as structured
from serving.engine.input_batch import InputBatch
from serving.engine.dp_attention import DataParallelAttention, StackedRunner
from serving.engine.dp_attention import check as check_lockstep
from serving.engine.input_prep import all_step_shapes, padding_step
from serving.engine.kv_event_publisher import start_kv_events
from serving.engine.parallel_sampling import ParentRequest
from serving.core.outputs import RequestOutput
from serving.core.request import Request
from serving.core.request_checks import check_logprobs, check_request_token_ids
from serving.engine.runner import (ModelRunner, StepResult, WarmupReport,
                                   disable_jax_compilation_cache)
from serving.core.sampling_params import SamplingParams
from serving.engine.step_ahead import InFlight, first_rows_by_request, runs_ahead
from serving.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from serving.core.spec_config import SpeculativeConfig
from serving.core.spec_decode import Drafter
from serving.engine.draft_model import DraftModel
from serving.engine.mtp_drafter import MtpDrafter
from serving.engine.embedder import Embedder, check_task
from serving.core.pooling_params import PoolingParams, resolve_task
from serving.engine.output_processor import OutputProcessor
from serving.engine.spec_outputs import emitted_tokens
from serving.engine.lora_slots import start_lora
from serving.kv_transfer.config import KVTransferConfig
from serving.lora.request import LoRAError, LoRARequest

log = logging.getLogger("xlaserve")


@dataclass
class _Pending:
    """Requests that got a token in the last step, emitted during the next one."""
    requests: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    result: StepResult | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        ec = config or EngineConfig.from_kwargs(**kwargs)
        memory_plan.configure_xla_allocator_if_unstarted(ec.gpu_memory_utilization)
        # Before anything starts JAX's backends: one runtime over every process.
        self.cluster = multiprocess.initialize(ec.coordinator_address, ec.num_processes,
                                               ec.process_id)
        on_gpu = jax.default_backend() == "gpu"
        ec = self.config = demo_defaults.resolve(ec, on_gpu)
        disable_jax_compilation_cache()
        self.attention_backend = resolve_backend(ec.attention_backend)
        engine_setup.check_config(ec)
        self.speculative_config = SpeculativeConfig.parse(ec.speculative_config)
        kv_events_config = KVEventsConfig.parse(ec.kv_events_config)
        self.task = resolve_task(ec.task, ec.runner)
        if self.task == "embed" and self.speculative_config:
            raise ValueError("--speculative-config is for generation, not --task embed")
        self.model_dir = sizing.resolve_model_dir(ec.model, ec.tokenizer)
        # -dp N with --enable-expert-parallel, or over several processes: N ranks in one
        # program (dp_attention.py, lockstep.py)
        self.lockstep = ec.data_parallel_size > 1 and (ec.enable_expert_parallel
                                                       or self.cluster is not None)
        if self.lockstep:
            check_lockstep(ec, self.model_dir, self.task, self.speculative_config)
        else:
            mesh.check_tensor_parallel_size(self.model_dir, ec.tensor_parallel_size,
                                            every_device=self.cluster is not None,
                                            expert_parallel=ec.enable_expert_parallel)
        DraftModel.check_devices(self.speculative_config, ec.tensor_parallel_size)
        dtype = sizing.resolve_dtype(ec.dtype, self.model_dir, on_gpu)
        started = time.perf_counter()
        # The tokenizer (importing transformers, most of a second) loads beside the weights.
        with ThreadPoolExecutor(1, thread_name_prefix="xlaserve-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, ec.tokenizer or self.model_dir)
            self.cfg, params = load_weights(self.model_dir, ec, dtype)
            self.timings = {"weights": time.perf_counter() - started}  # phase -> seconds
            self.tokenizer = tokenizer.result()
        self.cfg = replace(mesh.with_expert_parallel(
            self.cfg, ec.data_parallel_size if self.lockstep else ec.tensor_parallel_size,
            ec.enable_expert_parallel), moe_backend=ec.moe_backend)
        ec = self.config = linear_setup.check(ec, self.cfg, self.speculative_config)
        # --task embed: pooler and model facts (a bad --pooler-config fails here)
        self.embedder = (Embedder(self.model_dir, self.cfg.hidden_size, ec.pooler_config)
                         if self.task == "embed" else None)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.vocab_size = request_vocab_size(self.cfg.vocab_size, self.tokenizer)
        self.max_num_batched_tokens = ec.max_num_batched_tokens or 512
        self.weight_bytes = param_bytes(params)  # quantized: values + scales
        self.quantization = describe_quantization(params)
        self.placement = (DataParallelAttention(self.cfg, ec.data_parallel_size)
                          if self.lockstep else
                          mesh.placement(self.cfg, ec.tensor_parallel_size, ec.kv_cache_dtype,
                                         ec.data_parallel_rank * ec.tensor_parallel_size))
        self.state_bytes = linear_setup.place_state(ec, self.cfg, self.placement,
                                                    linear_setup.room(ec, self.placement,
                                                                      self.weight_bytes))
        # A saved program is bound to the devices it runs on (a mesh's, or a replica's
        # own), which are part of its key. Not over several processes: each holds a part
        # of the mesh, and those compile at every start.
        self.executable_dir = (str(Path(ec.compilation_cache_dir) / "executables")
                               if ec.compilation_cache_dir and jax.process_count() == 1
                               else None)
        self.draft = DraftModel.for_config(self.speculative_config, ec, on_gpu, self.tokenizer,
                                           self.vocab_size, self.attention_backend,
                                           self.executable_dir)
        spec = self.speculative_config
        self.mtp = (MtpDrafter.for_config(spec, ec, self.model_dir, self.cfg, self.vocab_size,
                                          self.attention_backend, self.executable_dir)
                    if spec and is_mtp_method(spec.method) else None)
        # One device's share: a tensor-parallel device holds its KV heads of every page. A
        # draft model's cache has a page for every page of the target's: sized together.
        page_bytes = (bytes_per_page(self.placement.model_cfg, ec.page_size, ec.kv_cache_dtype)
                      + (self.draft.page_bytes if self.draft else 0)
                      + (self.mtp.page_bytes if self.mtp else 0))
        # The stored tree is consumed here: the device holds the weights once before the
        # KV cache is sized and allocated.
        runner = StackedRunner if self.lockstep else ModelRunner
        self.runner = runner(self.cfg, params, num_pages=None, page_size=ec.page_size,
                                  attention_backend=self.attention_backend,
                                  kv_cache_dtype=ec.kv_cache_dtype, free_stacked=True,
                                  max_logprobs=ec.max_logprobs, vocab_size=self.vocab_size,
                                  executable_dir=self.executable_dir, placement=self.placement,
                                  pooling=self.embedder is not None,
                                  max_rows=(ec.request_buckets or (ec.max_num_seqs,))[-1])
        del params
        self.lora = start_lora(ec, self.runner, self.task) if ec.enable_lora else None
        plan = engine_setup.plan_cache(self, page_bytes)
        self.memory_plan, self.max_model_len = plan.memory_plan, plan.max_model_len
        self.num_pages, self.window_num_pages = plan.num_pages, plan.window_num_pages
        self.buckets, self.kv_cache_bytes = plan.buckets, plan.kv_cache_bytes
        self._cache_layout = (plan.window, plan.pool)
        self.runner.allocate_kv_cache(self.num_pages, self.window_num_pages)
        if self.placement.size > 1 and not self.lockstep:
            mesh.log_devices(self.placement, self.runner.params, self.runner.cache)
        self.step_shapes = all_step_shapes(self.buckets, ec.max_num_seqs)
        self.warmup_report: WarmupReport | None = None
        self._grammar_compiler: structured.GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._kv_events_config = kv_events_config
        self._new_host_state(ec.data_parallel_rank)
        # Prefill/decode disaggregation (--kv-transfer-config; serving/kv_transfer/)
        self.kv_transfer = _kv_transfer(KVTransferConfig.parse(ec.kv_transfer_config), self)

    def _new_host_state(self, rank: int) -> None:
        """What one rank schedules: its scheduler over its pages, step arrays, outputs,
        n > 1 parents, the step in flight, seeds, and its KV cache events (from the
        process that schedules; started last: nothing to close if a step above fails)."""
        ec, (window, pool) = self.config, self._cache_layout
        self.scheduler = Scheduler(SchedulerConfig(
            ec.max_num_seqs, self.max_num_batched_tokens, self.max_model_len, ec.page_size,
            self.num_pages, enable_prefix_caching=ec.enable_prefix_caching,
            model_key=model_key(self.model_dir, ec),
            max_loras=self.lora.config.max_loras if self.lora else 0, sliding_window=window,
            window_group=pool.window if pool else 0, window_num_pages=self.window_num_pages,
            num_lookahead_tokens=self.mtp.k - 1 if self.mtp else 0,
            state_slots=ec.max_num_seqs if self.linear else 0))
        self.input_batch = InputBatch(self.buckets, ec.page_size, ec.max_num_seqs,
                                      self.runner.bitmask_width,
                                      self.embedder and self.embedder.pooler.pooling_type)
        model_drafter = self.draft or self.mtp
        self.drafter = self.speculative_config and Drafter(
            self.speculative_config, model_drafter and model_drafter.proposer(
                self.speculative_config, self.scheduler, self.num_pages, self.buckets,
                ec.max_num_seqs))
        self._parents: dict[str, ParentRequest] = {}  # n > 1, by the caller's id
        self._pending = _Pending()
        self._flight: InFlight | None = None  # a step applied ahead (step_ahead.py)
        self._seeds = random.Random(ec.seed + rank)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self.faults = Faults.from_env()  # test hook, off unless configured
        self.kv_events = (start_kv_events(self._kv_events_config, rank,
                                          self.scheduler.kv_cache_manager)
                          if self.cluster is None or self.cluster.is_leader else None)

    def rank_replica(self, rank: int) -> "LLMEngine":
        """Data-parallel attention (serving/engine/lockstep.py): another rank's host state
        over this engine's model, runner and programs."""
        other = copy.copy(self)
        other._new_host_state(rank)
        return other

    @property
    def faults(self) -> Faults | None:
        return self._faults

    @faults.setter
    def faults(self, faults: Faults | None) -> None:
        self._faults = self.outputs.faults = faults

    @property
    def grammar_compiler(self) -> structured.GrammarCompiler:
        """Structured outputs' compiler, built on first use (wrapping the tokenizer for
        llguidance takes most of a second)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise structured.GrammarRefused("structured outputs need a tokenizer",
                                                    param="structured_outputs")
                if structured.llguidance is None:
                    raise structured.GrammarRefused(
                        "structured outputs need the llguidance package, which is not "
                        "installed here", param="structured_outputs")
                self._grammar_compiler = structured.GrammarCompiler(
                    self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar_compiler

    def device_weight_bytes(self) -> int:
        """Weight bytes on one device (the most any holds, tensor parallel)."""
        lora = self.runner.lora.num_bytes if self.runner.lora else 0
        if self.placement.size == 1:
            return self.weight_bytes + lora
        return self.placement.weight_bytes(self.runner.params) + lora

    @property
    def linear(self) -> bool:
        """A linear-attention hybrid (serving/engine/linear_setup.py)."""
        return self.cfg.num_linear_layers > 0

    def _activation_peak(self, max_len: int) -> int:
        """Temporaries of the largest step program at this context length."""
        b = sizing.buckets(self.config, max_len, self.max_num_batched_tokens,
                           self.attention_backend)
        largest = max(all_step_shapes(b, self.config.max_num_seqs))
        return self.runner.activation_peak_bytes(padding_step(largest, self.runner.hybrid_kv,
                                                                 self.linear))

    def warmup(self) -> WarmupReport:
        """Loads or compiles every program, then runs one step (its first run allocates
        what later steps reuse, and a program that cannot run fails here, before /health
        says 200). Records the phases in `timings`."""
        report = self.runner.warmup([padding_step(s, self.runner.hybrid_kv, self.linear)
                                     for s in self.step_shapes],
                                    self.config.progress)
        if self.draft or self.mtp:  # counted with the others
            draft = (self.draft.warmup(workers=os.cpu_count() or 1) if self.draft else
                     self.mtp.warmup(self.runner.params, workers=os.cpu_count() or 1))
            report.seconds += draft.seconds
            report.loaded += draft.loaded
            report.wall += draft.wall
        if self.runner.pooling:  # counted with the others; generation engines have none
            seconds, loaded = self.runner.pooling.compile()
            report.seconds.append(seconds)
            report.loaded += loaded
            report.wall += seconds
        self.warmup_report = report
        self.timings["compile/load"] = report.wall
        started = time.perf_counter()
        self.runner.fetch(self.runner.dispatch(padding_step(self.step_shapes[0],
                                                            self.runner.hybrid_kv,
                                                            self.linear)))
        self.timings["first step"] = time.perf_counter() - started
        if self.cluster is not None and self.cluster.is_leader:  # from now on, steps are sent
            self.runner.step_sink = self.cluster.send_step
        log.info("warm-up phases: %s", ", ".join(f"{k} {v:.1f} s"
                                                 for k, v in self.timings.items()))
        return report

    def describe(self) -> str:
        return engine_setup.describe(self)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, lora_request: LoRARequest | None = None) -> None:
        """Queues a request (an embedding one with PoolingParams, on a --task embed
        engine), with a LoRA adapter if `lora_request` names one; raises ValueError if it
        can never run."""
        check_task(self.task, params)
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt_token_ids, params)
        check_request_token_ids(prompt_token_ids, params, self.vocab_size)
        check_logprobs(params, self.config.max_logprobs)
        adapter = self._adapter(lora_request)
        parent = ParentRequest.expand(request_id, prompt_token_ids, params,
                                      partial(self._make_request, lora=adapter))
        first, *rest = parent.children
        if self.kv_transfer and params.kv_transfer_params:
            if rest:
                raise ValueError("kv_transfer_params go with n = 1")
            self.kv_transfer.add_request(first)
        # held ones are not in the scheduler yet
        if any(c.request_id in self.outputs.states for c in rest):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.add_request(first)  # the rest cannot fail after this
        if self.scheduler.config.enable_prefix_caching:
            parent.held = rest  # they join once the first has computed the shared prompt
        else:
            for child in rest:
                self.scheduler.add_request(child)
        for i, child in enumerate(parent.children):
            self.outputs.add(child, request_id, i)
        if rest:
            self._parents[request_id] = parent

    def _add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                             params: PoolingParams) -> None:
        req, collector = self.embedder.make_request(request_id, prompt_token_ids, params,
                                                    self.vocab_size)
        self.scheduler.add_request(req)
        self.outputs.add_pooling(req, collector)

    def _adapter(self, lora_request: LoRARequest | None):
        if lora_request is None:
            return None
        if self.lora is None:
            raise LoRAError("this engine serves no LoRA adapters: start it with "
                            "enable_lora=True (--enable-lora)")
        return self.lora.resolve(lora_request)

    def _make_request(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, lora=None) -> Request:
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                      seed=seed % 2**32, lora=lora)
        if params.structured_outputs is not None:
            req.grammar = self.grammar_compiler.matcher(params.structured_outputs)
            self.grammar_compiler.fill([req.grammar])
        return req

    def abort(self, request_id: str) -> None:
        """Aborts a request, all n samples of it."""
        parent = self._parents.pop(request_id, None)
        for child in parent.children if parent else []:
            self.scheduler.abort(child.request_id)
            self.outputs.forget(child.request_id)
        self.scheduler.abort(request_id)
        self.outputs.forget(request_id)
        if self.kv_transfer:
            self.kv_transfer.forget(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached page (the /reset_prefix_cache and /flush_cache endpoints);
        False, changing nothing, while any request is unfinished."""
        if self.has_unfinished:
            return False
        reset = self.scheduler.kv_cache_manager.reset_prefix_cache()
        if self.kv_events:
            self.kv_events.publish_pending()  # subscribers learn at once, not at the next step
        return reset

    def close(self) -> None:
        """Stops what runs beside the engine: the KV event publisher's thread and sockets."""
        if self.kv_events:
            self.kv_events.close()
        if self.kv_transfer:
            self.kv_transfer.close()

    @property
    def has_unfinished(self) -> bool:
        return self._has_work() or bool(self.scheduler.loading)

    def _has_work(self) -> bool:
        """Something step() would do now (requests waiting for their KV from another
        instance are not: they wait for it to land)."""
        return (self.scheduler.has_unfinished or bool(self._pending.requests)
                or self._flight is not None or any(p.held for p in self._parents.values()))

    def idle_s(self) -> float | None:
        """How long the engine thread may sleep before step() has work: 0 now; a KV
        transfer's deadline; None: until a command (or a transfer thread) wakes it."""
        if self._has_work():
            return 0.0
        return self.kv_transfer.wait_s() if self.kv_transfer else None

    def _release_held(self) -> None:
        """Gives the scheduler the samples whose first sibling has computed the prompt."""
        for request_id, parent in list(self._parents.items()):
            if parent.held and parent.ready_to_release():
                for child in parent.held:
                    if child.request_id in self.outputs.states:
                        self.scheduler.add_request(child)
                parent.held = []
            if all(c.request_id not in self.outputs.states for c in parent.children):
                del self._parents[request_id]

    def step(self) -> list[RequestOutput]:
        """One step. An exception from here means the engine's state is lost (the device
        failed, or the scheduler broke): the caller fails every request. A failure that
        belongs to one request (its sampling inputs, its detokenization) ends that request
        with finish_reason "error" and the step goes on. The KV cache events the step
        recorded go out as one batch after it."""
        outputs = self._step()
        if self.kv_events:
            self.kv_events.publish_pending()
        return outputs

    def _step(self) -> list[RequestOutput]:
        out = self.schedule_step()
        flight = self._flight  # the last step, if it ran ahead: settled below
        if not out.scheduled:
            return self._settle() + self.emit_pending()
        out, arrays, failed = self.prepare_step(out, flight and flight.rows)
        if arrays is None:
            return failed + self._settle() + self.emit_pending()
        if self.faults:
            self.faults.check("step", (s.request for s in out.scheduled))
        handle = self.runner.dispatch(arrays)
        if self.mtp:  # drafts from this step's hidden states, on the device
            self.mtp.launch(out, arrays, self.runner)
        outputs = failed + self._settle() + self.emit_pending()
        if runs_ahead(out, self):
            self._flight = InFlight(out, arrays, handle, self.scheduler.update_ahead(out))
            return outputs
        return outputs + self.finish_step(out, arrays, self.runner.fetch(handle))

    def schedule_step(self) -> SchedulerOutput:
        """A step's first phase: who runs and how many tokens (held samples released, KV
        transfers polled and started around it)."""
        self._release_held()
        if self.kv_transfer:
            self.kv_transfer.poll()
        out = self.scheduler.schedule()
        if self.kv_transfer:
            self.kv_transfer.start_loads()
        return out

    def finish_step(self, out: SchedulerOutput, arrays, result: StepResult
                    ) -> list[RequestOutput]:
        """A step's last phase, once its result is on the host: the tokens applied, the
        grammars advanced, the next proposals made; outputs are emitted during the next
        step (`emit_pending`). Returns the outputs of requests it failed."""
        failed = []
        if result.prompt is not None:
            self.outputs.collect_prompt_logprobs(out, result.prompt)
        if result.pooled is not None:
            self.embedder.collect(out, result.pooled, self.outputs.collector_of)
        changed = self.scheduler.update(out, emitted_tokens(out, arrays.first_rows, result))
        for req, error in structured.advance(self._grammar_compiler, changed):
            failed.append(self.outputs.fail(req.request_id,
                                            f"structured output failed: {error}"))
        if self.drafter:
            self.drafter.propose(self.scheduler.running)
        row = first_rows_by_request(out, arrays)
        self._pending = _Pending(changed, [row[r.request_id] for r in changed], result)
        return failed

    def _settle(self) -> list[RequestOutput]:
        """Fetches the step applied ahead, if any, writes its tokens over the placeholders
        (stops one step late) and emits its outputs."""
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        result = self.runner.fetch(flight.handle)
        if result.prompt is not None:
            self.outputs.collect_prompt_logprobs(flight.out, result.prompt)
        rows, sampled = flight.rows, result.tokens.tolist()
        tokens = [sampled[rows[req.request_id]] for req, _ in flight.ahead]
        changed = self.scheduler.resolve(flight.ahead, tokens)
        return self.outputs.emit(changed, [rows[r.request_id] for r in changed], result)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Ends every request with an error (after a failed step), freeing its pages."""
        self._pending = _Pending()
        flight, self._flight = self._flight, None
        if flight is not None:  # its device work ends before the engine's state is dropped
            with contextlib.suppress(Exception):
                self.runner.fetch(flight.handle)
        self._parents.clear()
        return self.outputs.fail_all(error)

    def _build(self, out: SchedulerOutput, prev_rows: dict[str, int] | None = None,
               shape: tuple[int, int, int] | None = None):
        if self.faults:
            self.faults.check("sampling", (s.request for s in out.scheduled))
        lora_slots = (self.lora.step_slots([s.request.lora for s in out.scheduled])
                      if self.lora else None)
        return self.input_batch.prepare(out, lora_slots, prev_rows, shape)

    def prepare_step(self, out: SchedulerOutput, prev_rows: dict[str, int] | None = None,
                     shape: tuple[int, int, int] | None = None):
        """(the step's requests, their arrays, error outputs). When the step's arrays cannot
        be built, each request is built alone to find the ones at fault; they fail, the
        rest runs. Arrays are None when no request is left. prev_rows: the last step's rows,
        when it ran ahead (step_ahead.py). shape: the bucket to build in (the ranks of
        data-parallel attention share one), instead of the smallest that holds the step."""
        try:
            return out, self._build(out, prev_rows, shape), []
        except Exception as e:  # noqa: BLE001 - one request's inputs must not fail a batch
            log.error("building a step failed (%s); retrying its requests one by one",
                      type(e).__name__)
        failed, gone = [], set()  # outputs carry the caller's id; gone holds the samples'
        for s in out.scheduled:
            try:
                self._build(SchedulerOutput([s]), prev_rows, shape)
            except Exception as e:  # noqa: BLE001 - this request is at fault
                failed.append(self.outputs.fail_alone(s.request.request_id, "sampling inputs",
                                                      e))
                gone.add(s.request.request_id)
        kept = SchedulerOutput([s for s in out.scheduled if s.request.request_id not in gone],
                               out.preempted)
        return kept, (self._build(kept, prev_rows, shape) if kept.scheduled else None), failed

    def emit_pending(self) -> list[RequestOutput]:
        """The last step's outputs (detokenized while this step runs on the device)."""
        p, self._pending = self._pending, _Pending()
        return self.outputs.emit(p.requests, p.rows, p.result)


def _kv_transfer(config: KVTransferConfig | None, engine: LLMEngine):
    if config is None:
        return None
    from serving.kv_transfer.connector import JaxTransferConnector  # jax.experimental.transfer
    return JaxTransferConnector(config, engine)
