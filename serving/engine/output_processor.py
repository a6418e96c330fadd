"""OutputProcessor: the tokens a step appended -> one RequestOutput per request that got any.

Host side, no JAX. The engine hands it the requests that got tokens and the step's rows; it
keeps each request's state (its detokenizer, what was already sent, its prompt logprobs or
pooled rows until they are complete) and builds the deltas the caller streams: new ids, new
text with stop strings held back, the rows' logprobs. A stop string found here ends the
request in the scheduler. A failure that belongs to one request (its detokenization) ends
that request alone with finish_reason "error".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from serving.core.outputs import RequestOutput, TokenLogprob
from serving.core.pooling import EmbeddingCollector
from serving.core.prompt_logprobs import PromptLogprobsCollector, wants_prompt_logprobs
from serving.core.request import Request
from serving.core.scheduler import Scheduler, SchedulerOutput
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.stream_detokenizer import StreamDetokenizer, make_detokenizer
from serving.engine.spec_outputs import feed_until_stop

log = logging.getLogger("xlaserve")


@dataclass(slots=True)
class RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer | StreamDetokenizer | None
    num_emitted: int = 0  # output tokens already sent
    prompt_logprobs: PromptLogprobsCollector | None = None  # until the first update has them
    parent_id: str = ""  # the id the caller gave; request.request_id is the sample's own
    index: int = 0  # which of the parent's n samples
    embedding: EmbeddingCollector | None = None  # an embedding request's pooled rows


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, faults=None):
        self.tokenizer, self.scheduler, self.faults = tokenizer, scheduler, faults
        self.states: dict[str, RequestState] = {}  # by the sample's own request id

    def add(self, req: Request, parent_id: str, index: int) -> None:
        """A generation request (one of its parent's n samples)."""
        p = req.sampling_params
        detok = self.tokenizer and make_detokenizer(
            self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output,
            p.min_tokens)
        prompt_lps = (None if p.prompt_logprobs is None else
                      PromptLogprobsCollector(req.prompt_token_ids, p.prompt_logprobs))
        self.states[req.request_id] = RequestState(req, detok, prompt_logprobs=prompt_lps,
                                                   parent_id=parent_id, index=index)

    def add_pooling(self, req: Request, collector: EmbeddingCollector) -> None:
        self.states[req.request_id] = RequestState(req, None, parent_id=req.request_id,
                                                   embedding=collector)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def collect_prompt_logprobs(self, out: SchedulerOutput, prompt) -> None:
        """Hands each request that asks for prompt logprobs its rows of the step's."""
        row_start = 0
        for s in out.scheduled:
            st = self.states.get(s.request.request_id)
            if st is not None and st.prompt_logprobs is not None and wants_prompt_logprobs(s):
                st.prompt_logprobs.add(s, row_start, prompt)
            row_start += s.num_new_tokens

    def collector_of(self, request_id: str) -> EmbeddingCollector | None:
        st = self.states.get(request_id)
        return st and st.embedding

    def fail(self, request_id: str, error: str) -> RequestOutput:
        """Ends one request with an error and frees its pages."""
        st = self.states.pop(request_id)
        self.scheduler.abort(request_id)
        return RequestOutput(st.parent_id, st.request.prompt_token_ids, finished=True,
                             finish_reason="error", error=error, index=st.index)

    def fail_alone(self, request_id: str, what: str, exc: Exception) -> RequestOutput:
        error = f"{what} failed: {type(exc).__name__}: {exc}"
        log.error("request %s: %s", request_id, error)
        return self.fail(request_id, error)

    def fail_all(self, error: str) -> list[RequestOutput]:
        return [self.fail(request_id, error) for request_id in list(self.states)]

    def emit(self, requests: list[Request], rows: list[int], result) -> list[RequestOutput]:
        """The outputs of requests that got tokens; rows[i]: requests[i]'s first row in
        the step's `result` (a StepResult)."""
        outputs = []
        for req, row in zip(requests, rows):
            st = self.states.get(req.request_id)
            if st is None:
                continue
            try:
                outputs.append(self._output(st, result, row))
            except Exception as e:  # noqa: BLE001 - fails this request only
                outputs.append(self.fail_alone(req.request_id, "detokenization", e))
        return outputs

    def _output(self, st: RequestState, result, row: int) -> RequestOutput:
        req = st.request
        queue_time = None
        if st.num_emitted == 0 and req.first_scheduled_time is not None:
            queue_time = req.first_scheduled_time - req.arrival_time
        new_ids = req.output_token_ids[st.num_emitted:]
        if self.faults:
            self.faults.check("detokenize", [req])
        detok, new_text, stop = st.detokenizer, "", None
        if detok is not None:
            new_text, stop, new_ids = feed_until_stop(detok, new_ids)
        st.num_emitted += len(new_ids)
        if stop is not None:
            self.scheduler.stop_on_string(req, stop, st.num_emitted)
        finished = req.status.is_finished
        if finished and detok is not None and stop is None:
            new_text += detok.flush()
        new_logprobs = None
        if (k := req.sampling_params.logprobs) is not None:
            new_logprobs = []
            for j, token in enumerate(new_ids):  # a verifying step: its rows in order
                top = list(zip(result.top_ids[row + j, :k].tolist(),
                               result.top_logprobs[row + j, :k].tolist()))
                new_logprobs.append(TokenLogprob(token, float(result.logprob[row + j]), top))
        prompt_logprobs = None
        if st.prompt_logprobs is not None:  # the first token: the prefill is done
            prompt_logprobs, st.prompt_logprobs = st.prompt_logprobs.entries, None
        embedding = None
        if finished:
            del self.states[req.request_id]
            if st.embedding:
                embedding = st.embedding.embedding()
        return RequestOutput(st.parent_id, req.prompt_token_ids, new_ids, new_text,
                             new_logprobs, finished, req.finish_reason, req.stop_reason, None,
                             queue_time, prompt_logprobs, st.index, embedding,
                             req.kv_transfer_params if finished else None)
