"""Engines on simulated CPU devices for tests/test_tensor_parallel.py, in a process of its own
(the device count is fixed when JAX starts, so the flag must never reach the test session):

    python -m tests.tp_child DEVICES CASES_JSON

Each case names a model folder, engine options and tensor-parallel sizes; the child builds
one engine per size, runs the same requests on each and prints one JSON line: per case and
size, the tokens and logprobs of every request and what the engine says of its devices."""
from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={sys.argv[1]}")
    os.environ["JAX_PLATFORMS"] = "cpu"

# One bucket each: the same tokens come out of any bucket on a CPU (batch invariance), and
# every program costs seconds to compile. Engines save their programs (a sharded one its
# mesh's) to the executable cache and load them on the next run.
SMALL = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, page_size=4,
             token_buckets=(16,), request_buckets=(4,), progress=False)
MAX_TOKENS = 8
PROMPTS = [[3, 5, 7, 9, 11, 13, 15], [17, 19, 23], [29, 31, 37, 41, 43, 47, 53, 59, 61, 67]]


def requests(max_tokens: int):
    from serving import SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [greedy,
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, seed=7, max_tokens=max_tokens, ignore_eos=True)]


def run_case(case: dict) -> dict:
    from serving import LLM, LoRARequest
    out = {}
    prompts = case.get("prompts", PROMPTS)
    params = requests(MAX_TOKENS)
    # per prompt: a LoRA adapter's folder or None (the engine options enable LoRA)
    loras = [path and LoRARequest(f"adapter{i}", i + 1, path)
             for i, path in enumerate(case.get("loras", [None] * len(prompts)))]
    # "restart": the sizes whose engine is built a second time, as a restarted server
    # would, reporting how many of its programs came from the executable cache
    runs = [(n, str(n)) for n in case["sizes"]]
    runs += [(n, f"{n}-restart") for n in case.get("restart", ())]
    for n, label in runs:
        started = time.perf_counter()
        llm = LLM(case["model"], tensor_parallel_size=n, **{**SMALL, **case["options"]})
        results = llm.generate(prompts, params, lora_request=loras)
        engine = llm.engine
        out[label] = {
            "tokens": [r.token_ids for r in results],
            "logprobs": [[lp.logprob for lp in r.logprobs] if r.logprobs else None
                         for r in results],
            "programs": engine.warmup_report.programs,
            "loaded": engine.warmup_report.loaded,
            "mesh": engine.placement.size,
            "kv_heads_per_device": engine.placement.model_cfg.num_kv_heads,
            "experts_per_device": engine.placement.model_cfg.local_experts,
            "device_weight_bytes": engine.device_weight_bytes(),
            "device_kv_bytes": _device_kv_bytes(engine),
            "lora_bytes": engine.runner.lora.num_bytes if engine.runner.lora else 0,
            "weight_bytes": engine.weight_bytes,
            "seconds": round(time.perf_counter() - started, 1),
        }
        del llm, engine
    return out


def _device_kv_bytes(engine) -> int:
    """The most KV cache bytes one device holds."""
    from serving.engine.mesh import per_device_bytes
    return max(per_device_bytes(engine.runner.cache).values())


def main() -> None:
    cases = json.loads(open(sys.argv[2]).read())
    print(json.dumps({name: run_case(case) for name, case in cases.items()}), flush=True)


if __name__ == "__main__":
    main()
