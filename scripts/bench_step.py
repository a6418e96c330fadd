"""Time one compiled forward step of a model over the paged cache, per bucket shape.

Each shape is TOKENSxROWSxPAGES (a step's token bucket, page-table rows and pages per row).
When TOKENS <= ROWS the step is decode: one token for each of TOKENS requests at position
--context. Otherwise it is one request's prefill chunk of TOKENS tokens from position 0. Prints
the best and median of --repeats runs of the same compiled program, with the cache donated as
the engine does. Sampling is not included. A model with linear-attention layers gets a state
slot for each row (scripts/bench_hybrid_step.py times such models).

    python scripts/bench_step.py                                   # the demo model, float32
    python scripts/bench_step.py --shapes 1x1x16,64x64x16 --attention-backend reference
    python scripts/bench_step.py --no-attention        # the matmuls and the rest alone
    python scripts/bench_step.py --shapes 64x64x16 --profile   # where a step's time goes
    python scripts/bench_step.py --moe-like 8,2      # dense vs MoE of equal active size
    python scripts/bench_step.py --moe-like 8,2 --quantize int4:lm_head   # the demo's form
    python scripts/bench_step.py --window 512 --contexts 512,1024,2048   # window vs full

--moe-like E,K times random float32 weights twice (quantized with --quantize's recipe where
given), prepared as the engine prepares them (CPU kernels packed, experts for the grouped
kernels): the model's own shape (dense), and the same
model with every MLP replaced by E experts, each token to K of them, each expert
intermediate_size // K wide (Mixtral's routing; the attention, embedding and head
unchanged), so both compute the same active parameters per token. For the demo model and
8,2: 8 experts of 768, two active = its MLP of 1536.

--window W times the model's decode steps (--rows requests, one token each) at every context
of --contexts, twice in turns: with full attention and with a sliding window of W keys on
every layer (the same weights). A window layer's kernel reads only the keys inside the
window, so the window model's step stays flat once the context passes W.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.attention import resolve_backend  # noqa: E402
from model.batch import Batch  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.kv_cache import KVCache  # noqa: E402
from model.runtime_params import prepare_params  # noqa: E402
from model.transformer import forward, init_params  # noqa: E402
from quant.recipe import quantize_params  # noqa: E402
from serving.engine.sizing import resolve_model_dir  # noqa: E402


def step_batch(T: int, R: int, P: int, page_size: int, num_pages: int, context: int, rng):
    if T <= R:  # decode: token i belongs to request i
        reqs, pos = np.arange(T), np.full(T, min(context, P * page_size) - 1)
        logits_indices = np.arange(R) % T
    else:  # one request's chunk
        reqs, pos = np.zeros(T, int), np.arange(T) % (P * page_size)
        logits_indices = np.full(R, T - 1)
    table = rng.permutation(np.arange(1, num_pages))[:R * P].reshape(R, P)
    slots = table[reqs, pos // page_size] * page_size + pos % page_size
    arrays = (rng.integers(0, 1000, T), pos, slots, reqs, table, logits_indices)
    return Batch(*(jax.numpy.asarray(a, np.int32) for a in arrays))


def profile(program, params, cache, batch, repeats: int):
    """Runs the step `repeats` times under jax.profiler; -> (ms per step by op kind, cache).
    Our kernels are named by their FFI target (q8_matmul by its output width), XLA's ops by
    their fusion kind. The time of a call is the calling thread's: a kernel's pool workers
    run inside it."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(repeats):
                logits, cache = program(params, cache, batch)
                logits.block_until_ready()
        path = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    hlo = program.as_text()
    kind = {m[1]: m[2] for m in re.finditer(r"%?([\w.-]+) = [^\n]*custom_call_target="
                                             r"\"(\w+)\"", hlo)}
    for m in re.finditer(r"%?([\w.-]+) = f32\[\d+,(\d+)\][^\n]*custom_call_target="
                         r"\"xlaserve_q8_matmul\"", hlo):
        kind[m[1]] = f"xlaserve_q8_matmul N={m[2]}"
    threads = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
               and e.get("name") == "thread_name" and "XLA" in e["args"]["name"]}
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (e["pid"], e["tid"]) in threads \
                and not e["name"].startswith(("ThunkExecutor", "end:")):
            totals[kind.get(e["name"], re.sub(r"[.\d]+$", "", e["name"]))] += e["dur"] / 1e3
    return {k: v / repeats for k, v in totals.most_common()}, cache


def moe_like(cfg: ModelConfig, experts: int, top_k: int) -> ModelConfig:
    """cfg with every MLP a mixture of `experts`, `top_k` per token, each expert
    intermediate_size // top_k wide: the same active parameters per token."""
    if cfg.architecture not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise SystemExit(f"--moe-like takes a Llama or Mistral model, not {cfg.architecture}")
    if cfg.intermediate_size % top_k:
        raise SystemExit(f"intermediate_size {cfg.intermediate_size} is not a multiple of "
                         f"top-{top_k}")
    return replace(cfg, architecture="MixtralForCausalLM", num_experts=experts,
                   num_experts_per_tok=top_k, moe_intermediate_size=cfg.intermediate_size
                   // top_k, norm_topk_prob=True, moe_layers=(True,) * cfg.num_layers)


def hybrid_batch(T: int, R: int, P: int, page_size: int, num_pages: int, context: int, rng):
    """step_batch's batch, with each row's state slot (row r in slot r + 1) and where its
    tokens start."""
    batch = step_batch(T, R, P, page_size, num_pages, context, rng)
    counts = [1] * T + [0] * (R - T) if T <= R else [T] + [0] * (R - 1)
    return replace(batch, state_slots=jax.numpy.arange(1, R + 1, dtype=np.int32),
                   query_start=jax.numpy.asarray(np.cumsum([0] + counts), np.int32))


class Stepper:
    """One model's compiled steps over its own paged cache (donated, as the engine does)."""

    def __init__(self, cfg, params, shapes, backend: str, args):
        self.params, self.args = params, args
        self.num_pages = 1 + max(R * P for _, R, P in shapes)
        self.cfg = cfg
        slots = 1 + max(R for _, R, _ in shapes) if cfg.num_linear_layers else 0
        self.cache = KVCache.zeros(cfg, self.num_pages, args.page_size, args.kv_cache_dtype,
                                   state_slots=slots)
        self.step = jax.jit(partial(forward, cfg=cfg, backend=backend), donate_argnums=(1,))
        self.rng = np.random.default_rng(0)

    def batch(self, shape):
        T, R, P = shape
        make = hybrid_batch if self.cfg.num_linear_layers else step_batch
        return make(T, R, P, self.args.page_size, self.num_pages, self.args.context, self.rng)

    def compile(self, shape):
        """-> (program, batch, compile seconds), the program run once."""
        batch = self.batch(shape)
        started = time.perf_counter()
        program = self.step.lower(self.params, self.cache, batch).compile()
        compile_s = time.perf_counter() - started
        self.run(program, batch)
        return program, batch, compile_s

    def run(self, program, batch) -> float:
        started = time.perf_counter()
        logits, self.cache = program(self.params, self.cache, batch)
        logits.block_until_ready()
        return time.perf_counter() - started

    def profile(self, program, batch, shape, label: str = "") -> None:
        by_op, self.cache = profile(program, self.params, self.cache, batch, self.args.repeats)
        shown = {k: v for k, v in by_op.items() if v >= 0.05}
        print(f"  {label}{'x'.join(map(str, shape))} by op, ms per step (summed over XLA's "
              f"threads: {sum(by_op.values()):.1f}): " +
              ", ".join(f"{k} {v:.1f}" for k, v in shown.items()), flush=True)


HEADER = ("| tokens | rows | pages | compile (s) | best (ms) | median (ms) | tokens/s |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")


def row(shape, compile_s: float, times: list[float]) -> str:
    best, median = min(times), float(np.median(times))
    return (f"| {' | '.join(map(str, shape))} | {compile_s:.1f} | {best * 1e3:.1f} | "
            f"{median * 1e3:.1f} | {shape[0] / best:.0f} |")


def bench(cfg, params, shapes, backend: str, args) -> None:
    """One model: a table row per shape."""
    stepper = Stepper(cfg, params, shapes, backend, args)
    print(HEADER)
    for shape in shapes:
        program, batch, compile_s = stepper.compile(shape)
        times = [stepper.run(program, batch) for _ in range(args.repeats)]
        print(row(shape, compile_s, times), flush=True)
        if args.profile:
            stepper.profile(program, batch, shape)


def bench_pair(models: dict, shapes, backend: str, args) -> None:
    """Two models' steps timed in turns, shape by shape, so that a load that comes and goes
    on a shared machine falls on both alike; a table per model, then their ratio."""
    steppers = {name: Stepper(cfg, params, shapes, backend, args)
                for name, (cfg, params) in models.items()}
    rows = {name: [] for name in models}
    bests = {name: {} for name in models}
    for shape in shapes:
        compiled = {name: s.compile(shape) for name, s in steppers.items()}
        times = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, s in steppers.items():
                times[name].append(s.run(*compiled[name][:2]))
        for name in models:
            rows[name].append(row(shape, compiled[name][2], times[name]))
            bests[name][shape] = min(times[name])
            if args.profile:
                steppers[name].profile(*compiled[name][:2], shape, f"{name}: ")
        print(f"# {'x'.join(map(str, shape))} done", flush=True)
    for name, (cfg, _) in models.items():
        mlp = (f"{cfg.num_experts} experts of {cfg.moe_intermediate_size}, top-"
               f"{cfg.num_experts_per_tok}" if cfg.num_experts
               else f"MLP {cfg.intermediate_size}")
        form = f" as {args.quantize}" if args.quantize else ""
        print(f"\n{name}: random {cfg.dtype} weights{form}, {mlp}, attention={backend}")
        print(HEADER + "\n" + "\n".join(rows[name]))
    a, b = models
    print(f"\n| tokens | rows | pages | {a} best (ms) | {b} best (ms) | {b} / {a} |")
    print("|---:|---:|---:|---:|---:|---:|")
    for shape in shapes:
        ta, tb = bests[a][shape], bests[b][shape]
        print(f"| {' | '.join(map(str, shape))} | {ta * 1e3:.1f} | {tb * 1e3:.1f} | "
              f"{tb / ta:.2f}x |")


def bench_window(cfg, params, window: int, contexts: list[int], rows: int, backend: str,
                 args) -> None:
    """Decode steps of `rows` requests at each context, full attention against a window of
    `window` keys on every layer."""
    configs = {"full": replace(cfg, sliding_windows=(0,) * cfg.num_layers),
               f"window {window}": replace(cfg, sliding_windows=(window,) * cfg.num_layers)}
    shapes = [(rows, rows, -(-c // args.page_size)) for c in contexts]
    steppers = {name: Stepper(c, params, shapes, backend, args) for name, c in configs.items()}
    print(f"| context | {' (ms) | '.join(configs)} (ms) | full - window (ms) |")
    print("|---:|---:|---:|---:|")
    for context, shape in zip(contexts, shapes):
        args.context = context
        compiled = {name: s.compile(shape) for name, s in steppers.items()}
        times = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, s in steppers.items():
                times[name].append(s.run(*compiled[name][:2]))
        best = [min(times[name]) * 1e3 for name in configs]
        print(f"| {context} | {best[0]:.2f} | {best[1]:.2f} | {best[0] - best[1]:.2f} |",
              flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo checkpoint)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantize", default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="auto, int8, fp8, or a float dtype such as bfloat16 (default: auto)")
    p.add_argument("--shapes", default=None,
                   help="default 1x1x16,8x8x16,16x16x16,64x64x16,256x64x16 (--moe-like: "
                        "1x1x16,16x16x16,64x64x16)")
    p.add_argument("--context", type=int, default=200, help="decode position + 1")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-pack", action="store_true",
                   help="leave the weights to XLA's dot (no CPU matmul kernels)")
    p.add_argument("--profile", action="store_true",
                   help="also the step's time by op (kernel or XLA fusion), under jax.profiler")
    p.add_argument("--no-attention", action="store_true",
                   help="attention replaced by the identity: what the rest of a step costs")
    p.add_argument("--moe-like", default=None, metavar="E,K",
                   help="random float32 weights of the model's shape (or --quantize's form), "
                        "dense and as E experts top-K of equal active size (see above)")
    p.add_argument("--window", type=int, default=0,
                   help="decode with full attention against a window of this many keys")
    p.add_argument("--contexts", default="512,1024,2048",
                   help="--window: the decode contexts, comma-separated")
    p.add_argument("--rows", type=int, default=16, help="--window: requests per step")
    args = p.parse_args()
    if args.no_attention:
        import model.transformer
        model.transformer.paged_attention = lambda q, *args, **kwargs: q
    model_dir = resolve_model_dir(args.model)
    backend = resolve_backend(args.attention_backend)
    shapes = args.shapes or ("1x1x16,16x16x16,64x64x16" if args.moe_like
                             else "1x1x16,8x8x16,16x16x16,64x64x16,256x64x16")
    shapes = [tuple(int(x) for x in s.split("x")) for s in shapes.split(",")]
    pack = False if args.no_pack else None
    if not args.moe_like:
        cfg, params = load_model(model_dir, args.dtype, progress=False, quantize=args.quantize)
        params = prepare_params(params, pack=pack)
        if args.window:
            print(f"{model_dir.name} {cfg.dtype} quantize={args.quantize} attention={backend}"
                  f" kv={args.kv_cache_dtype or 'auto'}, {args.rows} decode rows")
            bench_window(cfg, params, args.window, [int(c) for c in args.contexts.split(",")],
                         args.rows, backend, args)
            return 0
        print(f"{model_dir.name} {cfg.dtype} quantize={args.quantize} attention={backend}")
        bench(cfg, params, shapes, backend, args)
        return 0
    experts, top_k = (int(v) for v in args.moe_like.split(","))
    dense = ModelConfig.from_dir(model_dir, args.dtype or "float32")
    configs = {"dense": dense, f"moe {experts}x{top_k}": moe_like(dense, experts, top_k)}
    print(f"{model_dir.name}'s shape, dense and as a mixture of experts of equal active size,"
          f" quantize={args.quantize}")

    def weights(cfg):
        params = init_params(cfg)
        if args.quantize:
            params = quantize_params(params, args.quantize)
        return prepare_params(params, pack=pack)

    bench_pair({name: (cfg, weights(cfg)) for name, cfg in configs.items()}, shapes,
               backend, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
