"""Offline throughput: N random-token prompts through LLMEngine at several max_num_seqs, and the
same work one request at a time. Prints a table of output tokens/s and per-step times.

    python scripts/bench_offline.py --num-prompts 32 --input-len 128 --output-len 64 \
        --batch-sizes 1,8,32 --page-buckets 12 --token-buckets 8,32,128,512
    python scripts/bench_offline.py --num-prompts 64 --input-len 130 --output-len 128 \
        --batch-sizes 64 --sequential-prompts 0 --max-model-len 2048 --quantize int8:lm_head
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.core.config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.core.sampling_params import SamplingParams  # noqa: E402


def ints(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",")) if text else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint or HF folder (default: demo model)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8,32", help="max_num_seqs values, comma separated")
    p.add_argument("--sequential-prompts", type=int, default=None,
                   help="prompts for the one-at-a-time run (default: all; 0 skips it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: input-len + output-len")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache bytes (20GiB, 2000000000)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--token-buckets", type=ints, default=None)
    p.add_argument("--page-buckets", type=ints, default=None)
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--quantize", default=None, help="as `xlaserve serve --quantize`")
    p.add_argument("--kv-cache-dtype", default="auto", help="as `xlaserve serve --kv-cache-dtype`")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices to split the model over")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each step while the previous one runs (the engine's flag, "
                        "default on)")
    return p.parse_args(argv)


def engine_config(args, max_num_seqs: int) -> EngineConfig:
    kwargs = dict(model=args.model, dtype=args.dtype, max_num_seqs=max_num_seqs,
                  max_model_len=args.max_model_len or args.input_len + args.output_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                  kv_cache_memory=args.kv_cache_memory, attention_backend=args.attention_backend,
                  token_buckets=args.token_buckets, page_buckets=args.page_buckets,
                  quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype, progress=False,
                  tensor_parallel_size=args.tensor_parallel_size,
                  async_scheduling=args.async_scheduling)
    if args.compilation_cache_dir:
        kwargs["compilation_cache_dir"] = args.compilation_cache_dir
    return EngineConfig(**kwargs)


def run(engine: LLMEngine, prompts, params, tag: str) -> tuple[int, list[float], float]:
    """Adds the prompts, steps until all finish; -> (output tokens, step seconds, wall s)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps, tokens = [], 0
    started = time.perf_counter()
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t0)
        tokens += sum(len(o.new_token_ids) for o in outputs)
    return tokens, steps, time.perf_counter() - started


def row(mode: str, seqs: int, tokens: int, steps: list[float], wall: float) -> list[str]:
    ms = np.asarray(steps) * 1e3
    return [mode, str(seqs), str(len(steps)), f"{wall:.1f}", f"{tokens / wall:.1f}",
            f"{ms.mean():.1f}", f"{np.median(ms):.1f}", f"{np.percentile(ms, 99):.1f}"]


def print_table(rows: list[list[str]]) -> None:
    head = ["mode", "max_num_seqs", "steps", "wall s", "out tok/s", "step mean ms",
            "median ms", "p99 ms"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    batch_sizes = ints(args.batch_sizes)
    rows, prompts = [], None
    for seqs in batch_sizes:
        started = time.perf_counter()
        engine = LLMEngine(engine_config(args, seqs))
        compiled = engine.warmup()
        print(f"max_num_seqs {seqs}: {engine.describe()}; start-up "
              f"{time.perf_counter() - started:.1f} s ({compiled.wall:.1f} s loading or compiling)",
              flush=True)
        if prompts is None:  # the vocabulary's first 100 ids are mostly special tokens
            prompts = rng.integers(100, engine.cfg.vocab_size,
                                   (args.num_prompts, args.input_len)).tolist()
        run(engine, prompts[:1], params, "warm")  # first dispatches pay one-off costs
        tokens, steps, wall = run(engine, prompts, params, f"b{seqs}")
        assert tokens == args.num_prompts * args.output_len, tokens
        rows.append(row("batched", seqs, tokens, steps, wall))
        print_table(rows[-1:])
        n_seq = args.num_prompts if args.sequential_prompts is None else args.sequential_prompts
        if seqs == max(batch_sizes) and n_seq > 0:
            all_steps, tokens, wall = [], 0, 0.0
            for i, p in enumerate(prompts[:n_seq]):
                t, s, w = run(engine, [p], params, f"seq{i}")
                all_steps, tokens, wall = all_steps + s, tokens + t, wall + w
            rows.append(row("one at a time", seqs, tokens, all_steps, wall))
        del engine
    print(f"\n{args.num_prompts} prompts x {args.input_len} input tokens, {args.output_len} "
          f"output tokens each (greedy, ignore_eos)")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
