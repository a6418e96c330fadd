"""Time a mixture-of-experts layer's grouped matmuls on the CPU: our grouped kernels
(pallas_kernels/grouped_matmul_cpu.py) against the dense masked form plain jnp would run
(every row times every expert, an einsum batched over experts, then each row's own expert
selected), for float32 experts ("dense" kernel) and int8 experts with a scale per output
channel ("q8" kernel, the engine's packing of int8 weights; the masked form converts the
int8 values inside the einsum and scales after), and `jax.lax.ragged_dot` on float32
(XLA:CPU's own expansion).

The layer is Qwen3-MoE-like at the demo model's active size: hidden 576, 8 experts, top-2,
expert intermediate 768, so two experts make SmolLM2-135M's intermediate 1536; the joined
gate/up projection is [8, 576, 1536] and the down one [8, 768, 576].

Each token's top-2 experts come from random router logits; its two (token, expert) rows are
sorted by expert, so 1, 16 and 64 tokens make 2, 32 and 128 rows. Each program chains
--calls matmuls in a loop, the next input waiting on the last output (a scalar of it), so a
small matmul's time is not the program's dispatch; the table gives ms per matmul, the
fastest of --repeats programs (the machine may be shared).

    python scripts/bench_grouped_matmul.py [--tokens 1,16,64] [--experts 8] [--top-k 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import grouped_matmul_cpu  # noqa: E402

METHODS = ("grouped f32", "masked f32", "ragged_dot f32", "grouped int8", "masked int8")
RATIOS = (("masked f32", "grouped f32"), ("masked int8", "grouped int8"))


def int8_weights(w):
    """w float32[E, K, N] -> int8 values [E, K, N] and float32 scale [E, N], one scale per
    expert and output channel (symmetric, 127 levels)."""
    scale = np.abs(w).max(axis=1) / 127
    scale = np.where(scale > 0, scale, 1).astype(np.float32)
    values = np.clip(np.round(w / scale[:, None, :]), -127, 127).astype(np.int8)
    return values, scale


def expert_of_rows(group_sizes, rows: int):
    return jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=rows)


def every_expert(x, w):
    """x [M, K] against each expert's w [E, K, N] -> [E, M, N], as a matmul batched over E
    (x broadcast): XLA:CPU runs `rk,ekn->ren` about 3x slower at a few rows, copying the
    whole weight to transpose it."""
    return jnp.einsum("erk,ekn->ern", jnp.broadcast_to(x, (w.shape[0],) + x.shape), w)


def select(y, group_sizes):
    """y [E, M, N] -> [M, N]: each row's own expert's output."""
    expert = expert_of_rows(group_sizes, y.shape[1])
    return jnp.take_along_axis(y, expert[None, :, None], axis=0)[0], expert


def masked(x, group_sizes, w):
    """Every row against every expert, then each row's own: E times the grouped FLOPs."""
    return select(every_expert(x, w), group_sizes)[0]


def masked_int8(x, group_sizes, values, scale):
    """The same with int8 experts: the values converted inside the einsum, the selected
    row's channel scales applied after."""
    y, expert = select(every_expert(x, values.astype(x.dtype)), group_sizes)
    return y * scale[expert]


def methods(w):
    """name -> (operands, fn(x, group_sizes, *operands)) for the weight w float32[E, K, N]."""
    values, scale = int8_weights(w)
    grouped = lambda kind: (lambda x, gs, *p: grouped_matmul_cpu.grouped_matmul(  # noqa: E731
        kind, x, gs, *p))
    return {
        "grouped f32": (grouped_matmul_cpu.pack_experts("dense", w), grouped("dense")),
        "masked f32": ((jnp.asarray(w),), masked),
        "ragged_dot f32": ((jnp.asarray(w),), lambda x, gs, w: jax.lax.ragged_dot(x, w, gs)),
        "grouped int8": (grouped_matmul_cpu.pack_experts("q8", values, scale), grouped("q8")),
        "masked int8": ((jnp.asarray(values), jnp.asarray(scale)), masked_int8),
    }


def routed_group_sizes(tokens: int, experts: int, top_k: int, rng) -> np.ndarray:
    """Rows per expert when each token takes the top_k experts of random router logits."""
    logits = rng.standard_normal((tokens, experts))
    chosen = np.argsort(-logits, axis=1)[:, :top_k]
    return np.bincount(chosen.reshape(-1), minlength=experts).astype(np.int32)


def chained(fn, calls: int):
    """`calls` matmuls in one program, each input waiting on the last output."""
    @jax.jit
    def run(x, group_sizes, operands):
        def body(_, s):
            return jnp.max(fn(x + s, group_sizes, *operands)) * 0
        return jax.lax.fori_loop(0, calls, body, jnp.float32(0))
    return run


def time_ms(run, args, calls: int, repeats: int) -> float:
    """ms per matmul, the fastest of `repeats` programs: on a shared machine the others
    time its neighbours."""
    run(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(*args).block_until_ready()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3 / calls


def check(made, x, sizes) -> float:
    """max |grouped - masked| / max |masked| over both forms: the methods agree."""
    err = 0.0
    for got, want in (("grouped f32", "masked f32"), ("grouped int8", "masked int8"),
                      ("ragged_dot f32", "masked f32")):
        (pg, fg), (pw, fw) = made[got], made[want]
        a, b = np.asarray(fg(x, sizes, *pg)), np.asarray(fw(x, sizes, *pw))
        err = max(err, float(np.abs(a - b).max() / np.abs(b).max()))
    return err


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,16,64")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=768, help="per expert")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--calls", type=int, default=10, help="matmuls per program")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if not grouped_matmul_cpu.kernel_available("dense"):
        print("the grouped CPU kernels are not available here (a CPU backend and a C++ "
              "compiler are needed)")
        return 1
    rng = np.random.default_rng(0)
    E, H, I = args.experts, args.hidden, args.intermediate
    projections = {"gate/up": (H, 2 * I), "down": (I, H)}
    chosen = args.methods.split(",")
    made = {name: methods((rng.standard_normal((E, k, n)) / np.sqrt(k)).astype(np.float32))
            for name, (k, n) in projections.items()}
    ratios = [(a, b) for a, b in RATIOS if a in chosen and b in chosen]
    print(f"{E} experts, top-{args.top_k}, hidden {H}, expert intermediate {I}; float32 "
          f"activations; ms per matmul, best of {args.repeats} programs of {args.calls}\n")
    print("| projection | tokens | rows | " + " | ".join(f"{m} (ms)" for m in chosen)
          + "".join(f" | {a} / {b}" for a, b in ratios) + " |")
    print("|---|---:|---:|" + "---:|" * (len(chosen) + len(ratios)))
    worst = 0.0
    for tokens in [int(t) for t in args.tokens.split(",")]:
        sizes = jnp.asarray(routed_group_sizes(tokens, E, args.top_k, rng))
        for name, (k, _) in projections.items():
            x = jnp.asarray(rng.standard_normal((int(sizes.sum()), k)), jnp.float32)
            if set(chosen) >= set(METHODS):
                worst = max(worst, check(made[name], x, sizes))
            ms = {}
            for m in chosen:
                operands, fn = made[name][m]
                ms[m] = time_ms(chained(fn, args.calls), (x, sizes, operands), args.calls,
                                args.repeats)
            print(f"| {name} | {tokens} | {x.shape[0]} | "
                  + " | ".join(f"{ms[m]:.3f}" for m in chosen)
                  + "".join(f" | {ms[a] / ms[b]:.1f}x" for a, b in ratios) + " |", flush=True)
    if set(chosen) >= set(METHODS):
        print(f"\nmax |grouped - masked| / max |masked| over the cases: {worst:.1e} (int8: "
              "the kernel rounds each row to int16 first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
