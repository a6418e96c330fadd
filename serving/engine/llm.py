"""The offline API: `LLM(model_dir, **engine_options).generate(prompts, params)`, and on an
embedding engine (`task="embed"`) `.embed(prompts)`, as vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field

from serving.core.config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.core.outputs import CompletionOutput
from serving.core.pooling_params import PoolingParams
from serving.core.sampling_params import SamplingParams
from serving.lora.request import LoRARequest


@dataclass
class CompletionResult:
    """The result for one prompt: the first sample's fields, and all n samples in `outputs`."""
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs

    @property
    def prompt_logprobs(self):
        return self.outputs[0].prompt_logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's shape: `.outputs.embedding`)."""
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None = None
    finished: bool = False


class LLM:
    def __init__(self, model: str | None = None, *, warmup: bool = True, **engine_options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        if warmup:
            self.engine.warmup()
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[CompletionResult]:
        """prompts: a string, a list of token ids, or a list of either. lora_request: the
        adapter of every prompt, or one per prompt (None: the base model), on an engine
        with enable_lora=True."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        loras = (lora_request if isinstance(lora_request, list)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        results, ids = [], {}
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                logprobs = [] if p.logprobs is not None else None
                result = CompletionResult(tokens, [CompletionOutput(logprobs=logprobs)
                                                   for _ in range(p.n)])
                self._counter += 1
                request_id = f"offline-{self._counter}"
                self.engine.add_request(request_id, tokens, p, lora)  # it runs the n samples
                ids[request_id] = result
                results.append(result)
        except BaseException:
            # A refused prompt refuses the whole call: withdraw the ones already queued, or
            # they would run (and surface) in the next generate().
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        while self.engine.has_unfinished:
            for out in self.engine.step():
                ids[out.request_id].outputs[out.index].add(out)
        return results

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """prompts: a string, a list of token ids, or a list of either; the engine must run
        task="embed". pooling_params: one for all prompts or one each (dimensions,
        normalize)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        if isinstance(params, PoolingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} PoolingParams for {len(prompts)} prompts")
        results, ids = [], {}
        try:
            for prompt, p in zip(prompts, params):
                tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self._counter += 1
                request_id = f"offline-{self._counter}"
                self.engine.add_request(request_id, tokens, p)
                ids[request_id] = EmbeddingRequestOutput(tokens)
                results.append(ids[request_id])
        except BaseException:
            for request_id in ids:  # as generate(): a refused prompt refuses the call
                self.engine.abort(request_id)
            raise
        errors = []
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.error is not None:
                    errors.append(out.error)  # the others still finish, then it is raised
                    continue
                result = ids[out.request_id]
                result.finished = out.finished
                result.outputs = EmbeddingOutput(out.embedding)
        if errors:
            raise RuntimeError(f"embedding request failed: {errors[0]}")
        return results
