"""The `xlaserve` command: `serve` (the OpenAI-compatible server) and `warmup` (compile every
bucket into the persistent compilation cache, then exit)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from serving.config import EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint or Hugging Face folder (default: the demo model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size: bytes, or a fraction (<= 1) of free device memory")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--seed", type=int, default=0)


def _engine_config(args) -> EngineConfig:
    kwargs = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                  kv_cache_memory=args.kv_cache_memory, attention_backend=args.attention_backend,
                  seed=args.seed)
    if args.compilation_cache_dir:
        kwargs["compilation_cache_dir"] = args.compilation_cache_dir
    return EngineConfig(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaserve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--max-queued-requests", type=int, default=None)
    serve.add_argument("--grace-period", type=float, default=30.0,
                       help="seconds in-flight requests may take to finish on SIGTERM")
    warm = sub.add_parser("warmup", help="compile every bucket into the compilation cache")
    _engine_args(warm)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "warmup", "-h", "--help"):
        argv.insert(0, "serve")  # `python -m serving --model DIR` serves
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from serving.engine import LLMEngine
    started = time.perf_counter()
    try:
        engine = LLMEngine(_engine_config(args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"xlaserve: {engine.describe()}", flush=True)
    if args.command == "warmup":
        seconds = engine.warmup()
        print(f"xlaserve: compiled {len(seconds)} programs in {sum(seconds):.1f} s "
              f"(total {time.perf_counter() - started:.1f} s)")
        return 0
    return asyncio.run(_serve(engine, args, started))


async def _serve(engine, args, started: float) -> int:
    from serving.api_server import run_server
    from serving.async_engine import AsyncEngine
    async_engine = AsyncEngine(engine)
    name = args.served_model_name or (args.model or "SmolLM2-135M-Instruct")
    server = asyncio.create_task(run_server(
        async_engine, args.host, args.port, served_model_name=name, api_key=args.api_key,
        max_queued_requests=args.max_queued_requests, grace_period_s=args.grace_period))
    # /health answers 503 while the programs compile; warm-up runs off the event loop.
    await asyncio.to_thread(async_engine.start)
    print(f"xlaserve: ready in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        await server
    finally:
        async_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
