"""Where a step's host time goes: the engine on a tiny model (2 layers, 64 wide, random
weights, so the device's share is next to nothing) at 1 / 16 / 64 / 256 running requests,
every request decoding; per step, the milliseconds of each phase and of the device alone.

    python scripts/bench_host_overhead.py                        # vocabularies 512 and 49152
    python scripts/bench_host_overhead.py --vocab 49152 --requests 1,256 --logprobs 5
    python scripts/bench_host_overhead.py --no-async-scheduling   # each step fetched first

Phases, in the order LLMEngine.step runs them (docs/architecture.md, "A request's path"):
schedule (Scheduler.schedule), prep (the step's arrays: sampling inputs, page tables,
buckets), dispatch (launching the compiled program), outputs (detokenizing and building the
previous step's outputs: runs while the device computes), fetch wait (blocked on the device's
results), update (Scheduler.update: tokens appended, stops, pages). "step" is the wall time
of one LLMEngine.step(); "device" the same step's program dispatched and fetched back to back
with no host work between (median of repeats); "host on the path" = step - device, what the
device waits for. Only steps where every request decodes one token are counted. "mean
step" is their mean, which counts the garbage collector's rare long passes too.

    python scripts/bench_host_overhead.py --server              # also through the HTTP server

--server adds the same requests through `xlaserve serve` (the same tiny model, dummy weights)
and as many streaming clients (scripts/bench_serving.py, /v1/completions), all sent at once:
the median time per output token of a stream (TPOT) against the offline step. The difference
is what the server adds to a step: the event loop, SSE framing, the clients sharing this
machine's cores. (The median gap between chunks, ITL, is shown too; with many streams a
client reads several chunks at once and it drops towards zero.)
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("schedule", "prep", "dispatch", "outputs", "fetch wait", "update")


def tiny_model(folder: Path, vocab: int) -> Path:
    """A bare config.json: random weights are drawn at load (load_format="dummy")."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")))
    return folder


class PhaseClock:
    """Wraps the engine's phase methods on the instance; keeps each decode-only step's times."""

    def __init__(self, engine, num_requests: int):
        self.engine, self.n = engine, num_requests
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.last_arrays = None
        self._full = False
        self._timed(engine.scheduler, "schedule", "schedule", self._after_schedule)
        self._timed(engine, "prepare_step", "prep")
        self._timed(engine.runner, "dispatch", "dispatch", self._keep_arrays)
        self._timed(engine.outputs, "emit", "outputs")
        self._timed(engine.runner, "fetch", "fetch wait")
        self._timed(engine.scheduler, "update", "update")
        # async scheduling (serving/engine/step_ahead.py): a step is applied in two halves
        self._timed(engine.scheduler, "update_ahead", "update")
        self._timed(engine.scheduler, "resolve", "update")

    def reset(self, num_requests: int) -> None:
        """Counts from here the steps where `num_requests` requests all decode."""
        self.n, self.steps, self.last_arrays = num_requests, [], None

    def summary(self, repeats: int) -> dict:
        """Median seconds per counted step: each phase, the step, the device alone (the last
        counted step's program run `repeats` times) and the host on the path."""
        steps = self.steps[2:] or self.steps  # the first decode steps settle caches
        row = {phase: statistics.median(s.get(phase, 0.0) for s in steps) for phase in PHASES}
        row["step"] = statistics.median(s["step"] for s in steps)
        row["mean step"] = statistics.fmean(s["step"] for s in steps)  # with collector pauses
        row["device"] = device_alone(self.engine.runner, self.last_arrays, repeats)
        row["host on the path"] = max(row["step"] - row["device"], 0.0)
        row["steps"] = len(steps)
        return row

    def _timed(self, owner, name: str, phase: str, after=None) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            out = real(*args, **kwargs)
            self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - started
            if after:
                after(args, out)
            return out
        setattr(owner, name, timed)

    def _after_schedule(self, args, out) -> None:
        s = out.scheduled
        self._full = len(s) == self.n and all(x.num_new_tokens == 1 for x in s)

    def _keep_arrays(self, args, out) -> None:
        if self._full:
            self.last_arrays = args[0]

    def step(self) -> list:
        self.current = {}
        started = time.perf_counter()
        outputs = self.engine.step()
        wall = time.perf_counter() - started
        if self._full:
            self.steps.append(dict(self.current, step=wall))
        return outputs


def device_alone(runner, arrays, repeats: int) -> float:
    """Median seconds of the step's program dispatched and fetched with nothing between."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.fetch(runner.dispatch(arrays))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(model: Path, tokenizer: str | None, num_requests: int, args) -> dict:
    from serving.core.config import EngineConfig
    from serving.core.sampling_params import SamplingParams
    from serving.engine.llm_engine import LLMEngine
    import numpy as np
    engine = LLMEngine(EngineConfig(
        model=str(model), tokenizer=tokenizer, load_format="dummy", max_num_seqs=num_requests,
        max_model_len=args.prompt_len + args.max_tokens + 16, progress=False,
        compilation_cache_dir=args.compilation_cache_dir,
        async_scheduling=args.async_scheduling))
    engine.warmup()
    # As `xlaserve serve` does after warm-up (serving/cli.py): the collector's full passes
    # then walk what requests add, not the engine (a ~65 ms pause every ~100 steps at 256).
    gc.collect()
    gc.freeze()
    clock = PhaseClock(engine, num_requests)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True, logprobs=args.logprobs, seed=1)
    vocab = engine.cfg.vocab_size
    for i in range(num_requests):
        engine.add_request(f"r{i}", rng.integers(3, vocab, args.prompt_len).tolist(), params)
    while engine.has_unfinished:
        clock.step()
    gc.unfreeze()  # the next configuration's engine replaces this one
    return clock.summary(args.repeats)


def run_server(model: Path, vocab: int, tokenizer: str, num_requests: int, args,
               log_dir: Path) -> dict:
    """The median ITL and TPOT (seconds) of `num_requests` streams through the server."""
    import asyncio

    import numpy as np

    from scripts.bench_serving import SampleRequest, run_benchmark
    from scripts.bench_side_by_side import Server, free_port
    port = free_port()
    cmd = [sys.executable, "-m", "serving", "serve", str(model), "--load-format", "dummy",
           "--tokenizer", tokenizer, "--served-model-name", "tiny", "--port", str(port),
           "--max-num-seqs", str(num_requests),
           "--max-model-len", str(args.prompt_len + args.max_tokens + 16),
           "--compilation-cache-dir", args.compilation_cache_dir or ""]
    cmd += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    with Server(f"{model.name}-{num_requests}", cmd, port, log_dir) as server:
        server.wait_healthy(900)
        rng = np.random.default_rng(0)  # prompts as token ids, in the model's vocabulary
        requests = [SampleRequest(rng.integers(3, vocab, args.prompt_len).tolist(),
                                  args.prompt_len, args.max_tokens) for _ in range(num_requests)]
        result = asyncio.run(run_benchmark(server.base_url, "/v1/completions", "tiny",
                                           requests, max_concurrency=num_requests,
                                           temperature=args.temperature, quiet=True))
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['errors'][:2]}")
    return {"itl": result["median_itl_ms"] / 1e3, "tpot": result["median_tpot_ms"] / 1e3}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", default="512,49152", help="vocabulary sizes, comma separated")
    p.add_argument("--requests", default="1,16,64,256", help="running requests per step")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs every row asks for")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's --async-scheduling (default on): each step launched "
                        "while the previous one runs")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the demo model's, 49152 tokens)")
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--server", action="store_true",
                   help="also through `xlaserve serve` with streaming clients (see above)")
    args = p.parse_args(argv)
    tokenizer = args.tokenizer
    if tokenizer is None:
        from model import demo
        tokenizer = str(demo.fetch_demo_model(demo.cache_dir() / "demo" /
                                              "SmolLM2-135M-Instruct-hf"))
    rows = defaultdict(dict)
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in map(int, args.vocab.split(",")):
            model = tiny_model(Path(tmp) / f"tiny-{vocab}", vocab)
            for n in map(int, args.requests.split(",")):
                rows[vocab][n] = run(model, tokenizer, n, args)
                print(f"vocab {vocab}, {n} requests: step {1e3 * rows[vocab][n]['step']:.2f} ms",
                      file=sys.stderr, flush=True)
                if args.server:
                    served = run_server(model, vocab, tokenizer, n, args, Path(tmp))
                    rows[vocab][n] |= {f"server {k}": v for k, v in served.items()}
    cols = ("step", "mean step", "device", "host on the path") + PHASES
    print(f"temperature {args.temperature}, logprobs {args.logprobs}, prompts of "
          f"{args.prompt_len} tokens, {args.max_tokens} decoded; median ms per decode step")
    print("| vocab | requests | " + " | ".join(cols) + " |")
    print("|---:|---:|" + "---:|" * len(cols))
    for vocab, by_n in rows.items():
        for n, row in by_n.items():
            print(f"| {vocab} | {n} | " + " | ".join(f"{1e3 * row[c]:.2f}" for c in cols) + " |")
    if args.server:
        print("\nThrough the server: median ms between a stream's tokens (ITL) and per output "
              "token (TPOT), against the offline step")
        print("| vocab | requests | offline step | server TPOT | server ITL | TPOT - step |")
        print("|---:|---:|---:|---:|---:|---:|")
        for vocab, by_n in rows.items():
            for n, row in by_n.items():
                print(f"| {vocab} | {n} | {1e3 * row['step']:.2f} | "
                      f"{1e3 * row['server tpot']:.2f} | {1e3 * row['server itl']:.2f} | "
                      f"{1e3 * (row['server tpot'] - row['step']):.2f} |")


if __name__ == "__main__":
    main()
