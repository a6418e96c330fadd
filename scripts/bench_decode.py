"""End-to-end decode throughput of a random-weight model through the engine.

Writes a Llama-3.1-8B-shaped config.json (or --tiny's) to a temporary folder, builds
LLMEngine(load_format="dummy") once, and for each batch size runs that many requests of
--prompt-len random tokens for --output-len tokens (greedy, ignore_eos). Only steps in which
every one of the batch's requests decodes are timed (prefill steps, and the steps where some
requests have not started or have already finished, are not): the step budget is large
enough that all prompts are in before the first request ends. Reports tokens/s, step time and
the memory-read bound of such a step: (weight bytes it streams + the KV cache it reads at the
batch's mean context) / (measured copy bandwidth); pct_of_bound = bound / measured step time.
Under each row, the host's share of those steps (scripts/bench_host_overhead.py's phases):
each phase's median ms, the step's program alone ("device") and "host on the path" (step -
device: what the device waits for between steps).

--default-sizing leaves the KV cache to the engine's memory plan (--gpu-memory-utilization)
instead of sizing it for the batch, and reports the device's peak memory after warm-up.

    PYTHONPATH=. python scripts/bench_decode.py --batch-sizes 1,16,64,256     # GPU, 8B shape
    PYTHONPATH=. python scripts/bench_decode.py --tiny                        # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scripts.bench_host_overhead import PHASES, PhaseClock  # noqa: E402

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    bos_token_id=128000, eos_token_id=128001,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192))
TINY = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
        "bos_token_id": 1, "eos_token_id": 2}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy config (CPU smoke run)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,16,64,256; "
                   "--tiny: 1,4)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (--tiny: 16)")
    p.add_argument("--output-len", type=int, default=None, help="default 64 (--tiny: 8)")
    p.add_argument("--max-model-len", type=int, default=None, help="default 1024 (--tiny: 128)")
    p.add_argument("--dtype", default=None, help="default bfloat16 (--tiny on CPU: float32)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantize", default=None, help="weight recipe, e.g. int8 / fp8")
    p.add_argument("--kv-cache-dtype", default=None, help="auto / int8 / fp8")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many devices")
    p.add_argument("--default-sizing", action="store_true",
                   help="the engine's own KV cache sizing (the memory plan), not the batch's")
    p.add_argument("--compilation-cache-dir", default="",
                   help="JAX's persistent compilation cache ('' off: every run compiles)")
    p.add_argument("--warmup-only", action="store_true",
                   help="build and warm up the engine, report, and stop (with the same "
                        "options and --compilation-cache-dir: a warm restart)")
    p.add_argument("--max-seconds", type=float, default=float("inf"),
                   help="skip the remaining batch sizes once this much time has passed")
    p.add_argument("--out", type=Path, help="append the table to this file")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's flag (default on): each step launched while the "
                        "previous one runs; --no-async-scheduling fetches each step first")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    args.batch_sizes = [int(b) for b in (args.batch_sizes or
                                         ("1,4" if args.tiny else "1,16,64,256")).split(",")]
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.output_len = args.output_len or (8 if args.tiny else 64)
    args.max_model_len = args.max_model_len or (128 if args.tiny else 1024)
    args.dtype = args.dtype or ("float32" if args.tiny and not on_gpu else "bfloat16")
    return args


def engine_config(args, model_dir: Path):
    """One bucket per batch size (decode steps run exactly there), plus the prefill budget;
    one page bucket: a handful of programs to compile."""
    from model.config import ModelConfig
    from model.kv_cache import bytes_per_page
    from serving.core.config import EngineConfig
    page_size = 16
    max_seqs = max(args.batch_sizes)
    # Every prompt admitted in a few steps, so the whole batch decodes together for most of
    # --output-len (at 64 tokens a step, a batch of 256 never ran full).
    budget = max(max_seqs, 64, min(4096, max_seqs * args.prompt_len))
    tokens = tuple(sorted(set(args.batch_sizes) | {budget}))
    max_pages = -(-args.max_model_len // page_size)
    cfg = ModelConfig.from_dir(model_dir, args.dtype)
    extra = {}
    if args.quantize:
        extra["quantize"] = args.quantize
    if args.kv_cache_dtype:
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tensor_parallel_size > 1:  # one device's share of a page
        from model.sharding import local_config
        cfg = local_config(cfg, args.tensor_parallel_size)
    page_bytes = bytes_per_page(cfg, page_size, *([args.kv_cache_dtype] if args.kv_cache_dtype
                                                  else []))
    if not args.default_sizing:
        extra["kv_cache_memory"] = (max_seqs * max_pages + 2) * page_bytes
    return EngineConfig(
        model=str(model_dir), load_format="dummy", dtype=args.dtype,
        attention_backend=args.attention_backend, max_num_seqs=max_seqs,
        max_model_len=args.max_model_len, max_num_batched_tokens=budget, page_size=page_size,
        token_buckets=tokens, request_buckets=tuple(sorted(set(args.batch_sizes) | {max_seqs})),
        page_buckets=(max_pages,), compilation_cache_dir=args.compilation_cache_dir,
        tensor_parallel_size=args.tensor_parallel_size,
        async_scheduling=args.async_scheduling, progress=False, **extra)


def run_batch(engine, batch: int, args, rng, clock) -> dict:
    """Runs one batch; times the steps in which all `batch` requests decode a token. clock: a
    PhaseClock on the engine, which keeps those steps' phases."""
    from serving.core.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vocab = engine.cfg.vocab_size
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(3, vocab, args.prompt_len).tolist(), params)
    clock.reset(batch)
    started = time.perf_counter()
    seconds, emitted = [], []  # per engine.step(): its time, and the decode tokens it emitted
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outputs = clock.step()
        seconds.append(time.perf_counter() - t0)
        emitted.append(sum(1 for o in outputs if len(o.new_token_ids) == 1))
    total = time.perf_counter() - started
    # step() emits the previous step's tokens while the device runs its own: step i ran a
    # full batch when step i + 1 emitted `batch` tokens. Step i is timed when step i - 1 was
    # full too (steady state: the timing of i holds no prefill).
    full = [i for i in range(1, len(seconds) - 1)
            if emitted[i + 1] == batch and emitted[i] == batch]
    decode_s = sum(seconds[i] for i in full)
    steps = len(full)
    # Mean context a timed step reads: the prompt plus each request's tokens through it.
    through = np.cumsum(emitted)  # tokens emitted by the end of each step() call
    mean_ctx = (args.prompt_len + float(np.mean([through[i + 1] for i in full])) / batch
                if steps else float("nan"))
    return dict(batch=batch, decode_steps=steps, decode_tokens=steps * batch,
                decode_s=decode_s, step_ms=1e3 * decode_s / steps if steps else float("nan"),
                tok_per_s=steps * batch / decode_s if steps else float("nan"),
                mean_context=mean_ctx, other_s=total - decode_s)


def streamed_weight_bytes(engine) -> int:
    """Weight bytes one decode step reads on one device: all but the embedding table (a few
    rows of it; tensor parallel, the device's share of it)."""
    cfg = engine.cfg
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * \
        np.dtype(jax.numpy.dtype(cfg.dtype)).itemsize
    return engine.device_weight_bytes() - embed // engine.placement.size


def build(args, model_dir: Path):
    """-> (engine, seconds its warm-up took: compiling, or loading from the cache)."""
    from serving.engine.llm_engine import LLMEngine
    engine = LLMEngine(engine_config(args, model_dir))
    started = time.perf_counter()
    engine.warmup()
    return engine, time.perf_counter() - started


def main() -> int:
    args = parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
    from pallas_kernels.benchmark import copy_bandwidth
    from serving.engine.runner import device_memory_bytes, device_peak_bytes

    def emit(line: str) -> None:
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")

    began = time.perf_counter()
    bw = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY if args.tiny else LLAMA_8B))
        emit(f"# bench_decode on {jax.devices()[0].device_kind}: building the "
             f"{'tiny' if args.tiny else 'Llama-3.1-8B-shaped'} engine "
             f"(attention {args.attention_backend}, tensor parallel "
             f"{args.tensor_parallel_size})")
        failures = 0
        engine = None
        try:
            engine, compile_s = build(args, Path(tmp))
        except Exception as e:  # e.g. a kernel that fails to compile: still time the model
            failures += 1
            emit(f"# engine FAILED {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        if engine is None:
            if args.attention_backend == "reference":
                return 1
            gc.collect()  # the failed engine's weights and cache
            emit("# retrying with attention_backend=reference")
            args.attention_backend = "reference"
            engine, compile_s = build(args, Path(tmp))
        streamed = streamed_weight_bytes(engine)
        bound_ms = 1e3 * streamed / bw
        emit(f"# {engine.describe()}")
        if engine.memory_plan is not None:
            emit(f"# {engine.memory_plan.describe()}")
        peak = device_peak_bytes()
        if peak is not None:
            emit(f"# device peak memory after warm-up {peak / 2**30:.2f} GiB (limit "
                 f"{(device_memory_bytes() or 0) / 2**30:.2f} GiB)")
        emit(f"# warm-up of {len(engine.step_shapes)} programs took {compile_s:.1f} s (compilation "
             f"cache {args.compilation_cache_dir or 'off'}); copy "
             f"bandwidth {bw / 1e9:.1f} GB/s; weights streamed per step "
             f"{streamed / 2**30:.2f} GiB -> bound {bound_ms:.2f} ms/step")
        emit(f"# prompt {args.prompt_len} tokens, {args.output_len} output tokens, "
             f"dtype {args.dtype}, attention {engine.attention_backend}")
        if args.warmup_only:
            emit(f"# warm-up only: engine built and warm {time.perf_counter() - began:.1f} s "
                 "after start")
            return 1 if failures else 0
        emit("batch | full_steps | step_ms | tok_per_s | bound_ms | pct_of_bound | other_s")
        rng = np.random.default_rng(0)
        clock = PhaseClock(engine, 0)
        for batch in args.batch_sizes:
            if time.perf_counter() - began > args.max_seconds:
                emit(f"# stopped before batch {batch}: --max-seconds reached")
                break
            try:
                r = run_batch(engine, batch, args, rng, clock)
            except Exception as e:  # report, keep going with the other batch sizes
                failures += 1
                emit(f"# batch {batch}: FAILED {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
                engine.fail_all("benchmark error")  # next batch starts clean
                continue
            if not r["decode_steps"]:
                emit(f"# batch {batch}: no step ran the whole batch (raise --output-len)")
            kv_read = batch * r["mean_context"] * engine.kv_cache_bytes / (
                engine.num_pages * engine.config.page_size * engine.placement.size)
            step_bound_ms = 1e3 * (streamed + kv_read) / bw
            pct = 100 * step_bound_ms / r["step_ms"]
            emit(f"{batch} | {r['decode_steps']} | {r['step_ms']:.2f} | {r['tok_per_s']:.1f} | "
                 f"{step_bound_ms:.2f} | {pct:.1f} | {r['other_s']:.2f}")
            if clock.steps:
                h = clock.summary(repeats=5)
                emit(f"#   batch {batch} host per step (ms): " + ", ".join(
                    f"{k} {1e3 * h[k]:.2f}" for k in PHASES) + f"; step {1e3 * h['step']:.2f}, "
                    f"device alone {1e3 * h['device']:.2f}, host on the path "
                    f"{1e3 * h['host on the path']:.2f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
