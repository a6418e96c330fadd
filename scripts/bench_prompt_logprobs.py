"""What prompt logprobs cost a step: the engine's step (which also hands out its hidden
states, in blocks) against the step as it was without prompt logprobs, for steps where no row
asks and steps where one does (the step, then the prompt-logprobs program on each block).

    python scripts/bench_prompt_logprobs.py [--model DIR] [--shapes 1,16,128,512] [--repeats 20]

A shape N <= 16 is a decode step of N rows; larger, one request's prefill chunk of N tokens
(when it asks, all N positions are scored). Times are the median of --repeats rounds of
dispatch + fetch (tokens, and prompt logprobs when asked), cache donated, in milliseconds.
Also printed: the compile seconds of the step program with and without the hidden states,
and of the one prompt-logprobs program.
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
import numpy as np  # noqa: E402

from model.transformer import forward  # noqa: E402
from serving.core.request import Request  # noqa: E402
from serving.core.sampling_params import SamplingParams  # noqa: E402
from serving.core.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from serving.engine.input_prep import prepare  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.engine.runner import split_batch  # noqa: E402
from serving.engine.step_buffers import pack, unpack  # noqa: E402
from serving.engine.sampler import SamplingInputs, sample  # noqa: E402

DECODE_ROWS = 16


def without_prompt_logprobs(params, cache, buffers, *, layout, cfg, backend, num_top):
    """The step as it was before prompt logprobs: forward to the sampled rows, sampling."""
    batch, sampling = unpack(buffers, layout)
    logits, cache = forward(params, cache, split_batch(batch)[0], cfg, backend)
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


def interleaved_ms(runs: dict, repeats: int) -> dict[str, float]:
    """Median ms of each run, the runs taking turns (a shared machine drifts otherwise)."""
    times = {name: [] for name in runs}
    for i in range(repeats + 2):  # two rounds of warming up
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if i >= 2:
                times[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def baseline_run(engine: LLMEngine, jitted, arrays):
    """-> (compile seconds, one round) of the step without prompt logprobs."""
    runner = engine.runner
    buffers, layout = pack(arrays)
    started = time.perf_counter()
    program = jitted.lower(runner.params, runner.cache, buffers, layout=layout).compile()
    compile_s = time.perf_counter() - started

    def run():
        out, runner.cache = program(runner.params, runner.cache, jax.device_put(buffers))
        np.asarray(out.tokens)
    return compile_s, run


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
    prompt_compile_s = runner.compile_prompt_logprobs()
    print(f"{'step':>14} | {'before ms':>9} | {'no row asks ms':>14} | {'one row asks ms':>15} | "
          f"compile s: before / now")
    for n in (int(x) for x in args.shapes.split(",")):
        plain = step_arrays(engine, n, asks=False)
        compile_before, before = baseline_run(engine, baseline, plain)
        compile_now = runner.compile(plain.shape, plain)
        runs = {"before": before, "now": lambda: runner.fetch(runner.dispatch(plain))}
        if n > DECODE_ROWS:  # a decode row has no prompt position left to score
            asks = step_arrays(engine, n, True)
            runs["asks"] = lambda: runner.fetch(runner.dispatch(asks))
        ms = interleaved_ms(runs, args.repeats)
        kind = f"decode x{n}" if n <= DECODE_ROWS else f"prefill {n}"
        asks_ms = f"{ms['asks']:.2f}" if "asks" in ms else "-"
        print(f"{kind:>14} | {ms['before']:9.2f} | {ms['now']:14.2f} | {asks_ms:>15} | "
              f"{compile_before:.1f} / {compile_now:.1f}")
    print(f"the prompt-logprobs program compiled in {prompt_compile_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
