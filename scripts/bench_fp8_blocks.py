"""Time one matmul on the CPU at DeepSeek-V3's expert shapes (7168 -> 2048, 2048 -> 7168) for
fp8 weights with 128 x 128 block scales through their kernel (cpu/fp8_block_matmul.cc), fp8
weights with one scale per output channel through the dense kernel (codes, weight-only), and
bfloat16 weights through the dense kernel (what a bfloat16 model runs); optionally XLA's own
bfloat16 dot. Every form is packed as the server packs it at load; rows are float32.

    python scripts/bench_fp8_blocks.py [--rows 1,16,64] [--shapes 7168x2048,2048x7168]
                                       [--forms fp8-block,fp8-channel,bf16] [--repeats 15]

Prints a Markdown table: milliseconds a call (median) and the weight bytes read a second.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from quant.array import quantize  # noqa: E402
from quant.fp8_blocks import quantize_fp8_blocks  # noqa: E402
from quant.ops import matmul  # noqa: E402
from quant.packed import pack_codes, pack_dense, pack_fp8_blocks  # noqa: E402

FORMS = ("fp8-block", "fp8-channel", "bf16", "xla-bf16")
DEFAULT_FORMS = FORMS[:3]


def weight(form: str, k: int, n: int, rng):
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k))
    if form == "fp8-block":
        return pack_fp8_blocks(jax.tree.map(np.asarray, quantize_fp8_blocks(w)))
    if form == "fp8-channel":
        return pack_codes(quantize(w, jnp.float8_e4m3fn, axes=(-2,)))
    w = w.astype(jnp.bfloat16)
    return pack_dense(w) if form == "bf16" else w


def seconds(fn, x, w, repeats: int) -> float:
    fn(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(x, w).block_until_ready()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--shapes", default="7168x2048,2048x7168", help="in x out, comma-separated")
    p.add_argument("--forms", default=",".join(DEFAULT_FORMS), help=f"of {', '.join(FORMS)}")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    forms = args.forms.split(",")
    if unknown := [f for f in forms if f not in FORMS]:
        p.error(f"unknown form(s) {unknown}; there are {', '.join(FORMS)}")
    rng = np.random.default_rng(0)
    fn = jax.jit(matmul)
    print(f"one matmul on {jax.devices()[0].device_kind}, {os.cpu_count()} cores; ms a call "
          "(median), weight GB/s in brackets")
    print("| shape (in x out) | rows | " + " | ".join(forms) + " |")
    print("|---|---:|" + "---:|" * len(forms))
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        ws = {f: weight(f, k, n, rng) for f in forms}
        nbytes = {f: sum(a.nbytes for a in jax.tree.leaves(w)) for f, w in ws.items()}
        for rows in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
            cells = []
            for f in forms:
                s = seconds(fn, x, ws[f], args.repeats)
                cells.append(f"{s * 1e3:.2f} ({nbytes[f] / s / 1e9:.1f})")
            print(f"| {k} x {n} | {rows} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
