"""What XLA made of each quantized matmul on this device, and how fast it runs.

    python -m quant.hlo [--k 4096] [--n 14336] [--m 1,64] [--dtype bfloat16]

For each scheme (bf16, int8 per channel, fp8 per channel, fp8 per tensor) and each row count
m, it compiles `matmul(x[m, k], w[k, n])` as the model calls it and reads the optimized HLO:
- "cublasLt fp8": XLA's fp8 GEMM rewrite matched (docs/architecture.md, "Quantization");
  only fp8 per tensor can.
- "triton, convert fused": the int8/fp8 -> bf16 convert runs inside the Triton GEMM, so the
  weights are read once in 8 bits (what weight-only quantization needs to be fast).
- "cublas + separate convert" / "triton + separate convert": a fusion writes a bf16 copy of
  the weights first, then the GEMM: slower than bf16 itself.
Triton GEMMs are recognised by XLA's fusion kinds (TRITON_GEMM_KINDS), checked against
modules jaxlib 0.11.2 really compiled for an H200 (tests/data/gpu_hlo, captured without a GPU
by scripts/capture_gpu_hlo.py; nothing autotuned there, so the choice a real H200 makes is
what this module reports when run on one).
Then it times each compiled program. On a CPU the HLO holds plain dots ("dot").
"""
from __future__ import annotations

import argparse
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from quant.array import quantize
from quant.ops import matmul

SCHEMES = {  # name -> (storage dtype, scale axes) or None for the plain weight
    "bf16": None,
    "int8 channel": (jnp.int8, (-2,)),
    "fp8 channel": (jnp.float8_e4m3fn, (-2,)),
    "fp8 tensor": (jnp.float8_e4m3fn, (-2, -1)),
}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def computations(hlo: str) -> dict[str, str]:
    """HLO module text -> {computation name: its body}."""
    out, name, body = {}, None, []
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            name, body = m.group(1), []
        elif line.startswith("}") and name:
            out[name] = "\n".join(body)
            name = None
        elif name:
            body.append(line)
    return out


# XLA's fusion kinds for a GEMM emitted by Triton: jaxlib 0.11.2 emits the nested form (the
# dot's operands as nested fusions, tiled by "block_level_fusion_config"), older XLA the plain
# one. tests/data/gpu_hlo holds captured modules (scripts/capture_gpu_hlo.py).
TRITON_GEMM_KINDS = ("__triton_nested_gemm_fusion", "__triton_gemm")
_TRITON_FUSION = re.compile(r'calls=%?([\w.\-]+).*?"kind":"(' + "|".join(TRITON_GEMM_KINDS)
                            + r')"')


def _reachable(comps: dict[str, str], name: str) -> str:
    """The body of computation `name` and of every computation it calls (nested fusions)."""
    seen, todo, bodies = set(), [name], []
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        bodies.append(comps[c])
        todo += re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", comps[c])
    return "\n".join(bodies)


def _converts_weights(comps: dict[str, str]) -> bool:
    """Some fusion reads 8-bit values and converts them (a widened copy written to memory)."""
    return any("convert" in body and re.search(r"(s8|f8e4m3fn)\[", body)
               for body in comps.values())


def classify(hlo: str) -> str:
    """Which GEMM the optimized HLO of one matmul uses (see the module docstring)."""
    if "__cublas$lt$matmul$f8" in hlo:
        return "cublasLt fp8"
    comps = computations(hlo)
    calls = [m.group(1) for m in _TRITON_FUSION.finditer(hlo)]
    if calls:
        bodies = [_reachable(comps, c) for c in calls]
        fused = any(re.search(r"(s8|f8e4m3fn)\[", b) and "convert(" in b for b in bodies)
        if fused:
            return "triton, convert fused"
        return "triton + separate convert" if _converts_weights(comps) else "triton"
    if "__cublas$" in hlo:
        return "cublas + separate convert" if _converts_weights(comps) else "cublas"
    return "dot" if " dot(" in hlo or "dot." in hlo else "?"


def weight(name: str, k: int, n: int, dtype):
    w = jnp.asarray(np.random.default_rng(0).normal(0, 0.02, (k, n)), dtype)
    spec = SCHEMES[name]
    return w if spec is None else quantize(w, spec[0], spec[1])


def time_program(compiled, *args, iters: int = 50) -> float:
    jax.block_until_ready(compiled(*args))
    started = time.perf_counter()
    for _ in range(iters):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / iters


def report(k: int, n: int, ms: list[int], dtype=jnp.bfloat16, iters: int = 50) -> list[dict]:
    rows = []
    for name in SCHEMES:
        w = weight(name, k, n, dtype)
        for m in ms:
            x = jnp.ones((m, k), dtype)
            compiled = jax.jit(matmul).lower(x, w).compile()
            seconds = time_program(compiled, x, w, iters=iters)
            rows.append({"scheme": name, "m": m, "gemm": classify(compiled.as_text()),
                         "us": seconds * 1e6,
                         "GB/s": (sum(a.nbytes for a in jax.tree.leaves(w)) / seconds / 1e9)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--m", default="1,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="append the table to this file")
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.m.split(",")]
    lines = [f"matmul [m, {args.k}] @ [{args.k}, {args.n}] {args.dtype} on "
             f"{jax.devices()[0].device_kind}",
             f"{'scheme':<14} {'m':>4} {'gemm':<26} {'us':>9} {'weight GB/s':>11}"]
    print("\n".join(lines), flush=True)
    for r in report(args.k, args.n, ms, jnp.dtype(args.dtype), args.iters):
        lines.append(f"{r['scheme']:<14} {r['m']:>4} {r['gemm']:<26} {r['us']:>9.1f} "
                     f"{r['GB/s']:>11.0f}")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
