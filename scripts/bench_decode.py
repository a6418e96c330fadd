"""End-to-end decode throughput of a random-weight model through the engine.

Writes a Llama-3.1-8B-shaped config.json (or --tiny's) to a temporary folder, builds
LLMEngine(load_format="dummy") once, and for each batch size runs that many requests of
--prompt-len random tokens for --output-len tokens (greedy, ignore_eos). Decode is timed from
the step after every request has its first token to the last step. Reports tokens/s, step time
and the weight-streaming bound: (weight bytes a step must read) / (measured copy bandwidth).

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
    p.add_argument("--max-seconds", type=float, default=float("inf"),
                   help="skip the remaining batch sizes once this much time has passed")
    p.add_argument("--out", type=Path, help="append the table to this file")
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
    budget = max(max_seqs, 64)
    tokens = tuple(sorted(set(args.batch_sizes) | {budget}))
    max_pages = -(-args.max_model_len // page_size)
    cfg = ModelConfig.from_dir(model_dir, args.dtype)
    extra = {}
    if args.quantize:
        extra["quantize"] = args.quantize
    if args.kv_cache_dtype:
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    page_bytes = bytes_per_page(cfg, page_size, *([args.kv_cache_dtype] if args.kv_cache_dtype
                                                  else []))
    return EngineConfig(
        model=str(model_dir), load_format="dummy", dtype=args.dtype,
        attention_backend=args.attention_backend, max_num_seqs=max_seqs,
        max_model_len=args.max_model_len, max_num_batched_tokens=budget, page_size=page_size,
        kv_cache_memory=(max_seqs * max_pages + 2) * page_bytes, token_buckets=tokens,
        request_buckets=tokens, page_buckets=(max_pages,), progress=False, **extra)


def run_batch(engine, batch: int, args, rng) -> dict:
    from serving.core.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vocab = engine.cfg.vocab_size
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(3, vocab, args.prompt_len).tolist(), params)
    counts = dict.fromkeys(ids, 0)
    started = time.perf_counter()
    decode_start = None
    decode_steps = decode_tokens = 0
    while engine.has_unfinished:
        outputs = engine.step()
        new = 0
        for out in outputs:
            new += len(out.new_token_ids)
            counts[out.request_id] += len(out.new_token_ids)
        if decode_start is not None:
            decode_steps += 1
            decode_tokens += new
        elif all(counts.values()):  # prefill done: time every later step
            decode_start = time.perf_counter()
    total = time.perf_counter() - started
    seconds = time.perf_counter() - decode_start if decode_start else float("nan")
    return dict(batch=batch, decode_steps=decode_steps, decode_tokens=decode_tokens,
                decode_s=seconds, step_ms=1e3 * seconds / max(decode_steps, 1),
                tok_per_s=decode_tokens / seconds if decode_steps else float("nan"),
                prefill_s=total - (seconds if decode_start else 0.0))


def streamed_weight_bytes(engine) -> int:
    """Weight bytes one decode step reads: all but the embedding table (a few rows of it)."""
    cfg = engine.cfg
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * \
        np.dtype(jax.numpy.dtype(cfg.dtype)).itemsize
    return engine.weight_bytes - embed


def build(args, model_dir: Path):
    from serving.engine.llm_engine import LLMEngine
    engine = LLMEngine(engine_config(args, model_dir))
    return engine, engine.warmup().wall


def main() -> int:
    args = parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
    from pallas_kernels.benchmark import copy_bandwidth

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
             f"(attention {args.attention_backend})")
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
        emit(f"# warm-up compiled {len(engine.step_shapes)} programs in {compile_s:.1f} s; copy "
             f"bandwidth {bw / 1e9:.1f} GB/s; weights streamed per step "
             f"{streamed / 2**30:.2f} GiB -> bound {bound_ms:.2f} ms/step")
        emit(f"# prompt {args.prompt_len} tokens, {args.output_len} output tokens, "
             f"dtype {args.dtype}, attention {engine.attention_backend}")
        emit("batch | decode_steps | step_ms | tok_per_s | bound_ms | pct_of_bound | prefill_s")
        rng = np.random.default_rng(0)
        for batch in args.batch_sizes:
            if time.perf_counter() - began > args.max_seconds:
                emit(f"# stopped before batch {batch}: --max-seconds reached")
                break
            try:
                r = run_batch(engine, batch, args, rng)
            except Exception as e:  # report, keep going with the other batch sizes
                failures += 1
                emit(f"# batch {batch}: FAILED {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
                engine.fail_all("benchmark error")  # next batch starts clean
                continue
            pct = 100 * bound_ms / r["step_ms"]
            emit(f"{batch} | {r['decode_steps']} | {r['step_ms']:.2f} | {r['tok_per_s']:.1f} | "
                 f"{bound_ms:.2f} | {pct:.1f} | {r['prefill_s']:.2f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
