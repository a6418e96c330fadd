"""An embedding engine's side of LLMEngine (`--task embed`): its pooler and model facts, the
requests it makes, and the rows each step hands its collectors. Plain Python: the device
program is serving/engine/pooling.py, the pooling itself serving/core/pooling.py.

An embedding request is an ordinary prompt to the scheduler (chunked prefill, preemption,
the token budget), marked by `Request.pooling_params`: it finishes when its prompt is
computed, emits no token, reads nothing from the prefix cache and leaves nothing in it.
"""
from __future__ import annotations

from pathlib import Path

from serving.core.pooling import EmbeddingCollector, is_pooling
from serving.core.pooling_params import EmbeddingSpec, PoolerConfig, PoolingParams
from serving.core.request import Request
from serving.core.request_checks import check_token_ids
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import SchedulerOutput

# The sampling inputs of an embedding request's rows: its last chunk still has a sampled row
# (every step program samples), whose token nobody reads. Greedy costs the least.
_UNUSED_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


def check_task(task: str, params) -> None:
    """An embedding engine takes PoolingParams only, a generating one SamplingParams only."""
    if task == "embed" and not isinstance(params, PoolingParams):
        raise ValueError("this engine runs --task embed: it computes embeddings (LLM.embed, "
                         "/v1/embeddings) and generates no text")
    if task != "embed" and isinstance(params, PoolingParams):
        raise ValueError("embeddings need an engine started with --task embed (LLM(..., "
                         "task='embed')); this one generates text")


class Embedder:
    def __init__(self, model_dir: Path, hidden_size: int, pooler_config):
        self.pooler = PoolerConfig.parse(pooler_config, model_dir)
        self.spec = EmbeddingSpec.from_dir(model_dir, hidden_size, self.pooler)

    def describe(self) -> str:
        return (f"embeddings: {self.pooler.pooling_type} pooling, "
                f"{'normalized' if self.pooler.normalize else 'not normalized'}, "
                f"{self.spec.hidden_size} dimensions")

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                     vocab_size: int) -> tuple[Request, EmbeddingCollector]:
        """Raises RequestRefused (a ValueError) for ids outside the vocabulary or dimensions
        the model does not allow; the context length is the scheduler's to check."""
        check_token_ids(prompt_token_ids, vocab_size, "prompt")
        params = self.spec.resolve(params)
        req = Request(request_id, prompt_token_ids, _UNUSED_SAMPLING, pooling_params=params)
        return req, EmbeddingCollector(len(prompt_token_ids), self.pooler.pooling_type, params)

    @staticmethod
    def collect(out: SchedulerOutput, pooled, collector_of) -> None:
        """pooled: f32[T, H] the step's final-normed rows; collector_of: request id -> its
        EmbeddingCollector, or None (aborted meanwhile)."""
        row_start = 0
        for s in out.scheduled:
            c = collector_of(s.request.request_id) if is_pooling(s) else None
            if c is not None:
                c.add(s, row_start, pooled)
            row_start += s.num_new_tokens
