"""Async scheduling (`--async-scheduling`, vLLM's flag, on by default): step N+1 is
scheduled, prepared and launched while step N still runs on the device, so the host's work
for a step overlaps the device's instead of adding to it (docs/architecture.md, "A
request's path").

After step N is launched, `Scheduler.update_ahead` applies it without its tokens: each
sampling request gets a placeholder output, and the stops that do not depend on the token
(max_tokens, length) apply at once. Step N+1 takes a placeholder's token on the device, from
step N's sampled tokens (`prev_rows` into the runner's `last_tokens`). Once N+1 is launched,
N's tokens are fetched, written over the placeholders (`Scheduler.resolve`), checked for EOS
and stop tokens, detokenized and streamed; a request that stopped there and was scheduled in
N+1 is skipped when N+1 is applied, so no token past a stop, max_tokens or an abort is ever
emitted. Greedy and seeded tokens are the same as without it: the sampler's seed index counts
the placeholder as an output, and the step's inputs are the same numbers.

A step runs ahead only when its next one cannot depend on its tokens on the host: no request
in it has a grammar (the next bitmask follows the token), penalties (the next history holds
it) or proposed tokens, there is no drafter, and the engine is not an embedding engine or one
of several processes. Otherwise it is fetched and applied before the next is scheduled, as
without the flag.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from serving.core.request import Request
from serving.core.scheduler import SchedulerOutput
from serving.engine.input_prep import StepArrays


@dataclass
class InFlight:
    """A step launched and applied ahead, whose tokens have not reached the host."""
    out: SchedulerOutput
    arrays: StepArrays
    handle: object  # ModelRunner.dispatch's
    ahead: list[tuple[Request, int]]  # Scheduler.update_ahead's: request, placeholder index
    rows: dict[str, int] = field(init=False)  # each request's first sampled row in the step

    def __post_init__(self):
        self.rows = first_rows_by_request(self.out, self.arrays)


def first_rows_by_request(out: SchedulerOutput, arrays: StepArrays) -> dict[str, int]:
    """Each scheduled request's first sampled row in the step."""
    return {s.request.request_id: r for s, r in zip(out.scheduled, arrays.first_rows)}


def runs_ahead(out: SchedulerOutput, engine) -> bool:
    """Whether the step after `out` may be scheduled before out's tokens are on the host."""
    if (not engine.config.async_scheduling or engine.drafter or engine.embedder
            or engine.cluster is not None):
        return False
    for s in out.scheduled:
        req = s.request
        if s.spec_token_ids or req.grammar is not None or req.sampling_params.uses_penalties:
            return False
    return True
