"""Time the matmuls of a decode step alone: SmolLM2-135M's 30 layers (q/k/v joined 576x960,
o 576x576, gate/up joined 576x3072, down 1536x576) chained in one program, for int8 weights
through our CPU kernel, int4 weights (groups of 32) through theirs, int8 weights through XLA,
float32 weights through XLA, and float32 / bfloat16 weights through our batch-invariant dense
kernel (dense, dense-bf16).

    python scripts/bench_q8_matmul.py [--rows 1,16,64] [--layers 30] [--forms kernel,f32]
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

from quant.array import quantize  # noqa: E402
from quant.int4 import quantize_int4  # noqa: E402
from quant.ops import matmul  # noqa: E402
from quant.packed import pack, pack_dense, pack_int4  # noqa: E402

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # one layer's [in, out]
FORMS = ("kernel", "int4", "xla-int8", "f32", "dense", "dense-bf16")


def weights(form: str, layers: int, rng):
    out = []
    for _ in range(layers):
        for k, n in SHAPES:
            w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k))
            if form == "int4":
                w = pack_int4(quantize_int4(w))
            elif form.startswith("dense"):
                w = pack_dense(w.astype(jnp.bfloat16) if form == "dense-bf16" else w)
            elif form != "f32":
                w = quantize(w, jnp.int8, axes=(-2,))
                w = pack(w) if form == "kernel" else w
            out.append(w)
    return out


@jax.jit
def chain(x, ws):
    """Each matmul's input is the last output cut or tiled to its width, so they run in order."""
    for w in ws:
        k = w.shape[0]
        x = jnp.tanh(matmul(jnp.tile(x, (1, -(-k // x.shape[1])))[:, :k], w))
    return x.sum()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    forms = args.forms.split(",")
    print("| rows | " + " | ".join(f"{f} (ms)" for f in forms) + " |")
    print("|---:|" + "---:|" * len(forms))
    ws = {f: weights(f, args.layers, rng) for f in forms}
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
        cells = []
        for f in forms:
            chain(x, ws[f]).block_until_ready()
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                chain(x, ws[f]).block_until_ready()
                times.append(time.perf_counter() - started)
            cells.append(f"{np.median(times) * 1e3:.1f}")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
