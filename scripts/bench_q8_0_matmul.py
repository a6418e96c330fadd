"""Time one matmul at a time for int8 weights with a scale per group of 32 inputs (GGUF's
Q8_0) and per group of 16 (GGUF's Q6_K: 6-bit codes, float32 scales), and with a scale and an
offset per group (GGUF's Q5_1 and Q5_K in groups of 32, Q2_K in groups of 16) through our CPU
kernel, against 4-bit codes with a scale and offset per 32 (GGUF's Q4_1) through the int4
kernel, int8 weights with a scale per output channel through
theirs and float32 weights through XLA's dot, by default in SmolLM2-135M's shapes: the head
(576 x 49152) and a layer's (576 x 1536, 1536 x 576, 576 x 576).

Each program chains --calls matmuls, the next input waiting on the last output, so a small
matmul's time is not the program's dispatch; the table gives ms per matmul.

    python scripts/bench_q8_0_matmul.py [--rows 1,16,64] [--forms q8_0,q8,f32]
                                        [--shapes 1536x8960,8960x1536]
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

from pallas_kernels import q4_matmul_cpu, q8_0_matmul_cpu, q8_matmul_cpu  # noqa: E402

SHAPES = ((576, 49152), (576, 1536), (1536, 576), (576, 576))  # [in, out]
# q8_0-f32: the same codes with their scales as float32 (GGUF's are float16); q6_k: codes
# -32..31 in groups of 16 with float32 scales; q5_1: codes 0..31 in groups of 32, float16
# scales and offsets; q5_k, q2_k: codes 0..31 in groups of 32 and 0..3 in groups of 16,
# float32 scales and offsets (the kernel's min term); q4_1: the int4 kernel's codes 0..15
FORMS = ("q8_0", "q8_0-f32", "q6_k", "q5_1", "q5_k", "q2_k", "q4_1", "q8", "f32")
# the forms with a scale and an offset per group: group, top code, their dtype
MINS = {"q5_1": (32, 31, np.float16), "q5_k": (32, 31, np.float32),
        "q2_k": (16, 3, np.float32), "q4_1": (32, 15, np.float16)}


def weight(form: str, k: int, n: int, rng):
    """The form's operands for a random [k, n] weight, and the matmul taking them."""
    w = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    if form in MINS:
        group, top, dtype = MINS[form]
        groups = w.reshape(k // group, group, n)
        low = groups.min(axis=1)
        d = (groups.max(axis=1) - low) / top
        codes = np.clip(np.round((groups - low[:, None]) / d[:, None]), 0, top).reshape(k, n)
        d, low = d.astype(dtype), low.astype(dtype)
        if form == "q4_1":
            return q4_matmul_cpu.pack_panels(codes.astype(np.uint8), d, low), \
                q4_matmul_cpu.q4_matmul
        return q8_0_matmul_cpu.pack_panels(codes.astype(np.int8), d, low), \
            q8_0_matmul_cpu.q8_0_matmul
    if form == "q6_k":
        groups = w.reshape(k // 16, 16, n)
        d = np.abs(groups).max(axis=1) / 31
        codes = np.clip(np.round(groups / d[:, None]), -32, 31).astype(np.int8).reshape(k, n)
        return q8_0_matmul_cpu.pack_panels(codes, d.astype(np.float32)), \
            q8_0_matmul_cpu.q8_0_matmul
    if form.startswith("q8_0"):
        groups = w.reshape(k // 32, 32, n)
        d = np.abs(groups).max(axis=1) / 127
        codes = np.round(groups / d[:, None]).astype(np.int8).reshape(k, n)
        d = d.astype(np.float32 if form == "q8_0-f32" else np.float16)
        return q8_0_matmul_cpu.pack_panels(codes, d), q8_0_matmul_cpu.q8_0_matmul
    if form == "q8":
        scale = np.abs(w).max(axis=0) / 127
        codes = np.round(w / scale).astype(np.int8)
        return (q8_matmul_cpu.pack_panels(codes), jnp.asarray(scale)), q8_matmul_cpu.q8_matmul
    return (jnp.asarray(w),), jnp.matmul


def chained(fn, calls: int):
    @jax.jit
    def run(x, operands):
        for _ in range(calls):
            x = x + fn(x, *operands)[:, :1] * 0  # waits for the last output, costs T x K adds
        return x
    return run


def time_ms(run, x, operands, repeats: int) -> float:
    """The fastest of `repeats` runs: on a shared machine the others time its neighbours."""
    run(x, operands).block_until_ready()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(x, operands).block_until_ready()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES),
                   help="[in]x[out], comma-separated")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--calls", type=int, default=10, help="matmuls per program")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    forms = args.forms.split(",")
    print("| shape | rows | " + " | ".join(f"{f} (ms)" for f in forms) + " |")
    print("|---|---:|" + "---:|" * len(forms))
    for k, n in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        made = {f: weight(f, k, n, rng) for f in forms}
        calls = max(1, args.calls // 5) if n > 8192 else args.calls
        for rows in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
            cells = [time_ms(chained(fn, calls), x, ops, args.repeats) / calls
                     for ops, fn in made.values()]
            print(f"| {k}x{n} | {rows} | " + " | ".join(f"{c:.3f}" for c in cells) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
