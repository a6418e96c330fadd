"""What prompt logprobs cost a step: the engine's step program (forward, sampling, and the
prompt-logprobs branch under lax.cond) against the same step without the branch, for steps
where no row asks and steps where one does, and the compile time of each program.

    python scripts/bench_prompt_logprobs.py [--model DIR] [--shapes 1,16,128,512] [--repeats 20]

A shape N <= 16 is a decode step of N rows; larger, one request's prefill chunk of N tokens
(the rows that ask score all of it). Times are the median of --repeats dispatch + fetch
rounds of the compiled program, cache donated, in milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from model.batch import Batch  # noqa: E402
from model.transformer import forward  # noqa: E402
from serving.core.request import Request  # noqa: E402
from serving.core.sampling_params import SamplingParams  # noqa: E402
from serving.core.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from serving.engine.input_prep import prepare  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.engine.runner import _pack, _unpack  # noqa: E402
from serving.engine.sampler import SamplingInputs, sample  # noqa: E402

DECODE_ROWS = 16


def without_prompt_logprobs(params, cache, buffers, *, layout, cfg, backend, num_top):
    """The step as it was before prompt logprobs: forward to the sampled rows, sampling."""
    batch, sampling, _ = _unpack(buffers, layout)
    logits, cache = forward(params, cache, Batch(**batch), cfg, backend)
    return sample(logits, SamplingInputs(**sampling), num_top), cache


def step_arrays(engine: LLMEngine, n: int, asks: bool):
    page = engine.config.page_size
    params = SamplingParams(temperature=0.0, prompt_logprobs=5 if asks else None)
    if n <= DECODE_ROWS:  # n requests at position 99, one token each
        sched = []
        for i in range(n):
            req = Request(f"d{i}", list(range(10, 110)), params)
            pages = list(range(1 + 8 * i, 9 + 8 * i))
            sched.append(ScheduledRequest(req, 1, 99, [req.prompt_token_ids[99]], True, pages))
    else:
        req = Request("p", [(7 * i) % 1000 + 3 for i in range(n + 1)], params)
        pages = list(range(1, 1 + -(-n // page)))
        sched = [ScheduledRequest(req, n, 0, req.prompt_token_ids[:n], False, pages)]
    return prepare(SchedulerOutput(sched), engine.buckets, page, engine.config.max_num_seqs)


def time_program(engine: LLMEngine, jitted, arrays, repeats: int) -> tuple[float, float]:
    """-> (compile seconds, median ms per step)."""
    runner = engine.runner
    buffers, layout = _pack(arrays)
    started = time.perf_counter()
    program = jitted.lower(runner.params, runner.cache, buffers, layout=layout).compile()
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        *out, runner.cache = program(runner.params, runner.cache, jax.device_put(buffers))
        jax.block_until_ready(out)
        times.append(time.perf_counter() - started)
    return compile_s, 1e3 * statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shapes", default="1,16,128,512")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    engine = LLMEngine(model=args.model, dtype=args.dtype, max_num_seqs=DECODE_ROWS,
                       max_model_len=1024, progress=False, compilation_cache_dir=None)
    runner = engine.runner
    baseline = jax.jit(partial(without_prompt_logprobs, cfg=engine.cfg, backend=runner.backend,
                               num_top=engine.config.max_logprobs),
                       donate_argnums=(1,), static_argnames=("layout",))
    print(engine.describe())
    print(f"{'step':>14} | {'no branch ms':>12} | {'branch, no row asks ms':>22} | "
          f"{'one row asks ms':>15} | compile s: no branch / branch")
    for n in (int(x) for x in args.shapes.split(",")):
        plain = step_arrays(engine, n, asks=False)
        c0, t0 = time_program(engine, baseline, plain, args.repeats)
        c1, t1 = time_program(engine, runner._jitted, plain, args.repeats)
        asks = "-"
        if n > DECODE_ROWS:  # a decode row has no prompt position left to score
            asks = f"{time_program(engine, runner._jitted, step_arrays(engine, n, True), args.repeats)[1]:.2f}"
        kind = f"decode x{n}" if n <= DECODE_ROWS else f"prefill {n}"
        print(f"{kind:>14} | {t0:12.2f} | {t1:22.2f} | {asks:>15} | {c0:.1f} / {c1:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
