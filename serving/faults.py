"""Fault injection, for tests: make a device step, one request's sampling inputs or one
request's detokenization raise, to prove that a failure takes down only what it must.

Off by default. Set `LLMEngine.faults` to a `Faults`, or start the server with the
environment variable XLASERVE_FAULTS (read when the engine is built), a comma-separated list
of STAGE:SEED, e.g. XLASERVE_FAULTS=step:4242,detokenize:7. A stage fails for the requests
whose sampling seed is SEED, so a test picks its victims by the seed it sends:

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
    seeds: dict[str, frozenset[int]] = field(default_factory=dict)  # stage -> seeds

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        seeds: dict[str, set[int]] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            stage, _, seed = item.partition(":")
            if stage not in STAGES or not seed.lstrip("-").isdigit():
                raise ValueError(f"{ENV_VAR}: expected STAGE:SEED with STAGE one of "
                                 f"{', '.join(STAGES)}, got {item!r}")
            seeds.setdefault(stage, set()).add(int(seed))
        return cls({stage: frozenset(s) for stage, s in seeds.items()})

    @classmethod
    def from_env(cls) -> "Faults | None":
        spec = os.environ.get(ENV_VAR, "")
        return cls.parse(spec) if spec.strip() else None

    def hits(self, stage: str, request) -> bool:
        return request.sampling_params.seed in self.seeds.get(stage, ())

    def check(self, stage: str, requests) -> None:
        """Raises InjectedFault if a stage's victim is among the requests."""
        for req in requests:
            if self.hits(stage, req):
                raise InjectedFault(f"injected {stage} fault (seed "
                                    f"{req.sampling_params.seed})")
