"""Fault injection, for tests: make a device step, one request's sampling inputs or one
request's detokenization raise, to prove that a failure takes down only what it must.

Off by default. Set `LLMEngine.faults` to a `Faults`, or start the server with the
environment variable XLASERVE_FAULTS (read when the engine is built), a comma-separated list
of STAGE:SEED[:AFTER], e.g. XLASERVE_FAULTS=step:4242:3,detokenize:7. A stage fails for the
requests whose sampling seed is SEED, once they have AFTER output tokens (default 0), so a
test picks its victims by the seed it sends, and with AFTER > 0 fails them mid-stream:

    step        the device step of any batch holding such a request raises. The engine is
                then dead: every in-flight request gets an error, /health answers 503 and
                the server exits non-zero once its requests are answered.
    sampling    building the step's sampling inputs raises for such a request: that request
                fails, the rest of its batch runs.
    detokenize  detokenizing such a request's new tokens raises: that request fails, the
                others go on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV_VAR = "XLASERVE_FAULTS"
STAGES = ("step", "sampling", "detokenize")


class InjectedFault(RuntimeError):
    """What an injected fault raises."""


@dataclass
class Faults:
    victims: dict[str, dict[int, int]] = field(default_factory=dict)  # stage -> seed -> after

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        victims: dict[str, dict[int, int]] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            stage, *numbers = item.split(":")
            if stage not in STAGES or len(numbers) not in (1, 2) or not all(
                    n.lstrip("-").isdigit() for n in numbers):
                raise ValueError(f"{ENV_VAR}: expected STAGE:SEED[:AFTER] with STAGE one of "
                                 f"{', '.join(STAGES)}, got {item!r}")
            seed, after = int(numbers[0]), int(numbers[1]) if len(numbers) == 2 else 0
            victims.setdefault(stage, {})[seed] = after
        return cls(victims)

    @classmethod
    def from_env(cls) -> "Faults | None":
        spec = os.environ.get(ENV_VAR, "")
        return cls.parse(spec) if spec.strip() else None

    def hits(self, stage: str, request) -> bool:
        after = self.victims.get(stage, {}).get(request.sampling_params.seed)
        return after is not None and request.num_output_tokens >= after

    def check(self, stage: str, requests) -> None:
        """Raises InjectedFault if a stage's victim is among the requests."""
        for req in requests:
            if self.hits(stage, req):
                raise InjectedFault(f"injected {stage} fault (seed "
                                    f"{req.sampling_params.seed})")
