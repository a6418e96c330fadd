"""n > 1: one request id, n samples. The engine runs each sample as a child Request that
shares the parent's prompt; its outputs carry the parent's id and the sample's `index`.

With prefix caching on, the first child runs alone until its prompt is computed; then the
others join and find the prompt's full pages in the cache instead of computing them again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from serving.core.request import Request
from serving.core.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One sample's params. Seeded samples get seed, seed + 1, ... so they differ from each
    other yet stay reproducible."""
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


def child_request_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass
class ParentRequest:
    request_id: str
    children: list[Request]
    held: list[Request] = field(default_factory=list)  # not yet given to the scheduler

    @classmethod
    def expand(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               make_request: Callable[[str, list[int], SamplingParams], Request]
               ) -> "ParentRequest":
        children = [make_request(child_request_id(request_id, i), prompt_token_ids,
                                 child_params(params, i)) for i in range(params.n)]
        return cls(request_id, children)

    def ready_to_release(self) -> bool:
        """The first sample's prompt is computed (it has a token) or it ended."""
        first = self.children[0]
        return bool(first.output_token_ids) or first.is_finished
