"""A mixture-of-experts layer's expert MLP on this device: which path XLA takes for
`jax.lax.ragged_dot` and how fast it and our Pallas grouped matmul (what model/moe.py runs on
NVIDIA GPUs by default) are against two references, at a Qwen3-30B-A3B-like layer (hidden
2048, 128 experts, top-8, expert intermediate 768, bfloat16) or, with --hidden 7168
--intermediate 2048 --experts 256, DeepSeek-V3's experts:

- ragged_dot: the tokens' (token, expert) rows sorted by expert, gate/up [E, 2048, 1536]
  then down [E, 768, 2048], each one `quant.ops.grouped_matmul(..., "ragged_dot")`
  (--moe-backend ragged_dot);
- pallas: the same through our Pallas (Triton) grouped matmul,
  pallas_kernels/grouped_matmul_gpu.py (`quant.ops.grouped_matmul(..., "pallas")`, the
  default on a GPU; the interpreter elsewhere);
- dense bound: the same rows through one expert's weights, plain matmuls of the same FLOPs
  (what a grouped GEMM could at best do, apart from reading every hit expert's weights: the
  "read bound" column is those bytes over the measured copy bandwidth);
- dense fallback: every token through every expert (einsum over E), the outputs weighted by
  the routing weights, zero for the experts a token did not pick: E / k times the FLOPs.

The "ragged_dot HLO" column reads the compiled module: `ragged-dot` kept as an op, a cuDNN
fusion, or XLA's dense rewrite (dots doing the work of every row against every expert,
quant/moe_hlo.py: E times the FLOPs and a large temporary; what jaxlib 0.11.2 compiles for
an H200 without autotuning); then the GEMM kinds and custom calls, and the temporaries.
Each program chains --iters MLPs in a loop, the next input waiting on the last output; the
table gives us per MLP, best of --repeats. Rows are printed (and appended to --out) as they
finish; --max-seconds stops before a token count that would not fit.

    python scripts/gpu_moe_check.py [--tokens 16,64,256,1024] [--out TABLE]
    JAX_PLATFORMS=cpu python scripts/gpu_moe_check.py --smoke     # tiny shapes, on a CPU
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.benchmark import copy_bandwidth  # noqa: E402
from quant.moe_hlo import read  # noqa: E402
from quant.ops import grouped_matmul  # noqa: E402
from scripts.bench_kernels import Table  # noqa: E402  (printed, and appended to --out)

METHODS = ("ragged_dot", "pallas", "dense bound", "dense fallback")
COLUMNS = ("tokens", "rows", "experts hit", "ragged_dot us", "pallas us", "dense bound us",
           "read bound us", "dense fallback us", "fastest", "ragged / bound", "compile s",
           "ragged_dot HLO")


def expert_mlp(rows, group_sizes, w_gu, w_down, backend: str):
    """rows [M, H] sorted by expert -> [M, H]: each row through its expert's gated MLP, the
    grouped matmuls by quant.ops.grouped_matmul's `backend`."""
    gate, up = jnp.split(grouped_matmul(rows, w_gu, group_sizes, backend), 2, axis=-1)
    return grouped_matmul(jax.nn.silu(gate) * up, w_down, group_sizes, backend)


ragged_mlp = partial(expert_mlp, backend="ragged_dot")
pallas_mlp = partial(expert_mlp, backend="pallas")  # the interpreter off a GPU


def bound_mlp(rows, group_sizes, w_gu, w_down):
    """The same rows and FLOPs through expert 0's weights alone: plain matmuls."""
    gate, up = jnp.split(rows @ w_gu[0], 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ w_down[0]


def fallback_mlp(x, weights, w_gu, w_down):
    """x [T, H], weights [T, E] (zero where a token did not pick the expert) -> [T, H]:
    every token through every expert, masked by the routing weights. Written as batched
    matmuls over E (x broadcast): XLA:GPU copies the whole [E, H, 2I] weight to transpose it
    for the unbatched `th,ehn->ten`."""
    xe = jnp.broadcast_to(x, (w_gu.shape[0],) + x.shape)
    gate, up = jnp.split(jnp.einsum("eth,ehn->etn", xe, w_gu), 2, axis=-1)
    y = jnp.einsum("eti,eih->eth", jax.nn.silu(gate) * up, w_down)
    return jnp.einsum("eth,te->th", y, weights.astype(x.dtype))


def routing(T: int, E: int, k: int, rng):
    """Top-k experts of random router logits -> (experts int[T, k], weights float32[T, k],
    order: the (token, slot) pairs sorted by expert, group_sizes int32[E])."""
    logits = rng.standard_normal((T, E))
    experts = np.argsort(-logits, axis=1)[:, :k]
    top = np.take_along_axis(logits, experts, axis=1)
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    weights = (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)
    order = np.argsort(experts.reshape(-1), kind="stable")
    sizes = np.bincount(experts.reshape(-1), minlength=E).astype(np.int32)
    return experts, weights, order, sizes


def chained(fn, iters: int):
    """fn(x, *rest) run `iters` times in one program, each input waiting on the last output
    (a scalar of it added), so no call is hoisted and dispatch is paid once."""
    def run(x, *rest):
        def body(_, s):
            y = fn(x + s.astype(x.dtype), *rest)
            return jnp.max(y).astype(jnp.float32) * 0
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))
    return run


def compile_and_time(fn, args, iters: int, repeats: int):
    """-> (us per call, compile seconds, compiled program)."""
    started = time.perf_counter()
    compiled = jax.jit(chained(fn, iters)).lower(*args).compile()
    compile_s = time.perf_counter() - started
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - started)
    return best * 1e6 / iters, compile_s, compiled


def ragged_path(hlo: str, rows: int, E: int, H: int, I: int) -> str:
    """What XLA made of the expert MLP's ragged dots in a compiled module."""
    report = read(hlo, "compiled", rows, E, ((H, 2 * I), (I, H)))
    if re.search(r"\bragged-dot\(", hlo):
        path = "ragged-dot op"
    elif "cudnn" in hlo.lower():
        path = "cuDNN fusion"
    elif report.dense:
        path = f"dense rewrite, dots {report.work:.0f}x the grouped work"
    else:
        path = "no ragged-dot"
    kinds = sorted(set(re.findall(r'"kind":"(__[\w$]+)"', hlo))
                   | set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    return path + (f" ({', '.join(kinds)})" if kinds else "")


def temp_mib(compiled) -> str:
    try:
        return f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB temp"
    except Exception:  # not every backend reports it
        return "temp ?"


def agreement(T, x, experts, weights, order, sizes, w_gu, w_down) -> float:
    """max |grouped MLP - dense fallback| / max |dense fallback| over T tokens, the larger of
    ragged_dot's and the Pallas kernel's, the rows combined by the routing weights on the
    host."""
    k = experts.shape[1]
    rows = x[order // k]
    ragged = np.asarray(jax.jit(ragged_mlp)(rows, sizes, w_gu, w_down), np.float32)
    pallas = np.asarray(jax.jit(pallas_mlp)(rows, sizes, w_gu, w_down), np.float32)
    dense_w = np.zeros((T, w_gu.shape[0]), np.float32)
    np.put_along_axis(dense_w, experts, weights, axis=1)
    want = np.asarray(jax.jit(fallback_mlp)(x, dense_w, w_gu, w_down), np.float32)
    worst = 0.0
    for out in (ragged, pallas):
        got = np.zeros_like(want)
        np.add.at(got, order // k, out * weights.reshape(-1)[order][:, None])
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=None, help="default 16,64,256,1024 (--smoke: 4,16)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=768, help="per expert")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--iters", type=int, default=10, help="MLPs per program")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true",
                   help="hidden 256, 8 experts, top-2, intermediate 128 (checks it on a CPU)")
    p.add_argument("--label", default="", help="a note for the table's title line")
    p.add_argument("--max-seconds", type=float, default=float("inf"))
    p.add_argument("--out", type=Path, help="append the table to this file")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        args.hidden, args.experts, args.top_k, args.intermediate = 256, 8, 2, 128
    tokens = [int(t) for t in (args.tokens or ("4,16" if args.smoke else "16,64,256,1024"))
              .split(",")]
    chosen = args.methods.split(",")
    H, E, k, I = args.hidden, args.experts, args.top_k, args.intermediate
    dtype = jnp.dtype(args.dtype)
    key_gu, key_down = jax.random.split(jax.random.PRNGKey(0))
    # drawn in the weights' dtype: DeepSeek-V3's 22.5 GB of bf16 experts would be 45 GB in f32
    w_gu = jax.random.normal(key_gu, (E, H, 2 * I), dtype) * jnp.asarray(H ** -0.5, dtype)
    w_down = jax.random.normal(key_down, (E, I, H), dtype) * jnp.asarray(I ** -0.5, dtype)
    expert_bytes = (H * 2 * I + I * H) * dtype.itemsize
    bw = copy_bandwidth()
    table = Table(args.out)
    table.line(f"# gpu_moe_check on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
               f"jax {jax.__version__}{', ' + args.label if args.label else ''}: expert MLP, "
               f"hidden {H}, {E} experts, top-{k}, expert intermediate {I}, {dtype.name}; "
               f"copy bandwidth {bw / 1e9:.0f} GB/s")
    table.line("| " + " | ".join(COLUMNS) + " |")
    table.line("|" + "---:|" * (len(COLUMNS) - 1) + "---|")
    rng = np.random.default_rng(0)
    failures, last_s = 0, 0.0
    for T in tokens:
        elapsed = time.perf_counter() - started
        if elapsed + last_s > args.max_seconds:
            table.line(f"# stopped before {T} tokens: --max-seconds {args.max_seconds:.0f}")
            break
        t0 = time.perf_counter()
        experts, weights, order, sizes = routing(T, E, k, rng)
        x = jnp.asarray(rng.standard_normal((T, H)), dtype)
        rows = x[order // k]
        dense_w = np.zeros((T, E), np.float32)
        np.put_along_axis(dense_w, experts, weights, axis=1)
        runs = {"ragged_dot": (ragged_mlp, (rows, jnp.asarray(sizes), w_gu, w_down)),
                "pallas": (pallas_mlp, (rows, jnp.asarray(sizes), w_gu, w_down)),
                "dense bound": (bound_mlp, (rows, jnp.asarray(sizes), w_gu, w_down)),
                "dense fallback": (fallback_mlp, (x, jnp.asarray(dense_w), w_gu, w_down))}
        us, compile_s, hlo = {}, {}, "-"
        for m in chosen:
            fn, fn_args = runs[m]
            try:
                us[m], compile_s[m], compiled = compile_and_time(fn, fn_args, args.iters,
                                                                 args.repeats)
            except Exception as e:  # one failing method must not hide the others
                failures += 1
                table.line(f"# {T} tokens, {m}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            if m == "ragged_dot":
                hlo = (ragged_path(compiled.as_text(), T * k, E, H, I) + ", "
                       + temp_mib(compiled))
        hit = int((sizes > 0).sum())
        fmt = lambda m: f"{us[m]:.1f}" if m in us else "-"  # noqa: E731
        candidates = [m for m in ("ragged_dot", "pallas", "dense fallback") if m in us]
        faster = min(candidates, key=us.get) if candidates else "-"
        ratio = (f"{us['ragged_dot'] / us['dense bound']:.1f}x"
                 if "ragged_dot" in us and "dense bound" in us else "-")
        read_us = (hit * expert_bytes + 2 * T * k * H * dtype.itemsize) / bw * 1e6
        table.line(f"| {T} | {T * k} | {hit} | {fmt('ragged_dot')} | {fmt('pallas')} | "
                   f"{fmt('dense bound')} | "
                   f"{read_us:.1f} | {fmt('dense fallback')} | {faster} | {ratio} | "
                   f"{' / '.join(f'{compile_s[m]:.1f}' for m in chosen if m in compile_s)} | "
                   f"{hlo} |")
        if T == tokens[0] and set(chosen) >= {"ragged_dot", "dense fallback"}:
            err = agreement(T, x, experts, weights, order, sizes, w_gu, w_down)
            table.line(f"# {T} tokens: ragged_dot and pallas against the dense fallback, max |diff| / "
                       f"max |fallback| = {err:.2e}")
            if not err < 0.05:
                failures += 1
        last_s = time.perf_counter() - t0
    table.line("# compile s: " + " / ".join(chosen) + "; us per expert MLP (best of "
               f"{args.repeats} programs of {args.iters}); read bound: the hit experts' "
               "weights and the rows in and out over the copy bandwidth")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
