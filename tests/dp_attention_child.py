"""Data-parallel attention on simulated CPU devices, for tests/test_dp_attention.py, in a
process of its own (the device count is fixed when JAX starts):

    python -m tests.dp_attention_child RANKS CASES_JSON

Each case names a mixture-of-experts model folder and engine options; the child runs the
same requests on one engine (the reference) and on a LockstepEngine of RANKS ranks, once
with the requests spread over the ranks and once all on the last rank (the others step on
padding), and prints one JSON line: per case, each run's tokens and logprobs and what the
engine says of its devices."""
from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={sys.argv[1]}")
    os.environ["JAX_PLATFORMS"] = "cpu"

from tests.tp_child import MAX_TOKENS, PROMPTS, SMALL, requests  # noqa: E402


def run_lockstep(engine, params, ranks: list[int]) -> dict:
    tokens = {i: [] for i in range(len(PROMPTS))}
    logprobs = {i: [] for i in range(len(PROMPTS))}
    for i, (prompt, p, rank) in enumerate(zip(PROMPTS, params, ranks)):
        engine.assign(str(i), rank)
        engine.add_request(str(i), prompt, p)
    for _ in range(200):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_token_ids
            if out.new_logprobs:
                logprobs[int(out.request_id)] += [lp.logprob for lp in out.new_logprobs]
    return {"tokens": [tokens[i] for i in range(len(PROMPTS))],
            "logprobs": [logprobs[i] or None for i in range(len(PROMPTS))]}


def run_case(case: dict, ranks: int) -> dict:
    from serving import LLM
    from serving.core.config import EngineConfig
    from serving.engine.lockstep import LockstepEngine
    options = {**SMALL, **case["options"]}
    params = requests(MAX_TOKENS)
    reference = LLM(case["model"], **options).generate(PROMPTS, params)
    out = {"reference": {"tokens": [r.token_ids for r in reference],
                         "logprobs": [[lp.logprob for lp in r.logprobs] if r.logprobs
                                      else None for r in reference]}}
    if case.get("reference_only"):  # for a run elsewhere (two processes: the test's)
        return out
    engine = LockstepEngine(EngineConfig(model=case["model"], data_parallel_size=ranks,
                                         enable_expert_parallel=True, **options))
    engine.warmup()
    out["spread"] = run_lockstep(engine, params, [i % ranks for i in range(len(PROMPTS))])
    out["last_rank"] = run_lockstep(engine, params, [ranks - 1] * len(PROMPTS))
    placement = engine.primary.placement
    out["devices"] = placement.size
    out["experts_per_device"] = placement.model_cfg.local_experts
    out["programs"] = engine.primary.warmup_report.programs
    return out


def main() -> None:
    ranks = int(sys.argv[1])
    cases = json.loads(open(sys.argv[2]).read())
    print(json.dumps({name: run_case(case, ranks) for name, case in cases.items()}),
          flush=True)


if __name__ == "__main__":
    main()
