"""One engine start for tests/test_startup.py, in its own process (a restart is a new process;
in one process JAX's in-memory caches would hide what a restart does):

    python -m tests.startup_child CHECKPOINT CACHE_DIR

prints one JSON line: programs loaded / compiled, the JAX compile events of the warm-up, and
the tokens of a fixed workload."""
from __future__ import annotations

import json
import random
import sys

import jax

from serving import LLM, SamplingParams
from tests.demo_engine import greedy

SMALL = dict(max_num_seqs=4, max_model_len=48, max_num_batched_tokens=16, page_size=4,
             token_buckets=(2, 4, 8, 16), request_buckets=(2, 4), progress=False)
_events: list[str] = []
_listening = [False]


def _on_event(name: str, *args, **kwargs) -> None:
    if _listening[0] and name.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
        _events.append(name)


def workload(llm: LLM, rng: random.Random) -> list[list[int]]:
    """Prefill chunks, mixed steps, decode, penalties, logprobs, sampling: many shapes."""
    lengths = [1, 3, 7, 15, 20, 33, 2, 9]
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in lengths]
    kinds = [greedy(6), SamplingParams(temperature=0.8, seed=3, max_tokens=5),
             greedy(4, logprobs=2), greedy(5, frequency_penalty=0.5, repetition_penalty=1.2)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    out = [r.token_ids for r in llm.generate(prompts, params)]
    out += [r.token_ids for r in llm.generate([prompts[0]], greedy(3))]  # alone: smallest
    return out


def main(checkpoint: str, cache_dir: str) -> None:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    llm = LLM(checkpoint, compilation_cache_dir=cache_dir, warmup=False, **SMALL)
    _listening[0] = True
    report = llm.engine.warmup()
    _listening[0] = False
    print(json.dumps(dict(programs=report.programs, loaded=report.loaded,
                          compiled=report.compiled, events=_events,
                          tokens=workload(llm, random.Random(1)))))


if __name__ == "__main__":
    main(*sys.argv[1:3])
