"""What XLA made of each quantized matmul on this device, and how fast it runs.

    python -m quant.hlo [--k 4096] [--n 14336] [--m 1,64] [--dtype bfloat16] [--schemes ...]

For each scheme (bf16, int8 per channel, fp8 per channel, fp8 per tensor, fp8 with 128 x 128
block scales) and each row count m, it compiles `matmul(x[m, k], w[k, n])` as the model calls
it and reads the optimized HLO:
- "cublasLt fp8": XLA's fp8 GEMM rewrite matched (docs/architecture.md, "Quantization");
  only fp8 per tensor can.
- "triton fp8": a Triton GEMM whose operands are both fp8 (fp8 blocks up to 64 rows: fp8
  activations per row and input block, one batched dot over the input blocks).
- "fp8 reduce": no GEMM, a reduction over the fp8 weights read once (XLA's form of a
  one-row fp8 block matmul).
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
from quant.fp8_blocks import quantize_fp8_blocks
from quant.ops import matmul

SCHEMES = {  # name -> (storage dtype, scale axes), "blocks" or None for the plain weight
    "bf16": None,
    "int8 channel": (jnp.int8, (-2,)),
    "fp8 channel": (jnp.float8_e4m3fn, (-2,)),
    "fp8 tensor": (jnp.float8_e4m3fn, (-2, -1)),
    "fp8 block": "blocks",  # 128 x 128 block scales (quant/fp8_blocks.py)
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


_FP8_DOT = re.compile(r"= f32\[[\d,]*\]\S* dot\(")


def _dot_of_fp8(body: str) -> bool:
    """A GEMM computation whose dot takes fp8 operands as they are (no convert before)."""
    params = dict(re.findall(r"%([\w.\-]+) = (\w+)\[[\d,]*\]\S* parameter\(", body))
    for m in re.finditer(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", body):
        operands = []
        for name in m.groups():  # through a transpose or bitcast of a parameter
            src = re.search(rf"%{re.escape(name)} = \S+ (?:transpose|bitcast)\(%([\w.\-]+)\)",
                            body)
            operands.append(params.get(src.group(1) if src else name))
        if operands == ["f8e4m3fn", "f8e4m3fn"]:
            return True
    return False


def classify(hlo: str) -> str:
    """Which GEMM the optimized HLO of one matmul uses (see the module docstring)."""
    if "__cublas$lt$matmul$f8" in hlo:
        return "cublasLt fp8"
    comps = computations(hlo)
    calls = [m.group(1) for m in _TRITON_FUSION.finditer(hlo)]
    if calls:
        bodies = [_reachable(comps, c) for c in calls]
        if any(_dot_of_fp8(b) for b in bodies):
            return "triton fp8"
        fused = any(re.search(r"(s8|f8e4m3fn)\[", b) and "convert(" in b for b in bodies)
        if fused:
            return "triton, convert fused"
        return "triton + separate convert" if _converts_weights(comps) else "triton"
    if "__cublas$" in hlo:
        return "cublas + separate convert" if _converts_weights(comps) else "cublas"
    if " dot(" in hlo or "dot." in hlo:
        return "dot"
    reduces_fp8 = any(" reduce(" in body and "f8e4m3fn[" in body and "multiply(" in body
                      for body in comps.values())
    return "fp8 reduce" if reduces_fp8 else "?"


def quantizer(name: str):
    """A float weight [k, n] -> the scheme's form (jnp, so `jax.eval_shape` takes it)."""
    spec = SCHEMES[name]
    if spec is None:
        return lambda w: w
    if spec == "blocks":
        return quantize_fp8_blocks
    return lambda w: quantize(w, spec[0], spec[1])


def weight(name: str, k: int, n: int, dtype):
    return quantizer(name)(jnp.asarray(np.random.default_rng(0).normal(0, 0.02, (k, n)), dtype))


def time_program(compiled, *args, iters: int = 50) -> float:
    jax.block_until_ready(compiled(*args))
    started = time.perf_counter()
    for _ in range(iters):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / iters


def report(k: int, n: int, ms: list[int], dtype=jnp.bfloat16, iters: int = 50,
           schemes=tuple(SCHEMES)):
    """One row (a dict) per scheme and m, yielded as each is measured."""
    for name in schemes:
        w = weight(name, k, n, dtype)
        for m in ms:
            x = jnp.ones((m, k), dtype)
            compiled = jax.jit(matmul).lower(x, w).compile()
            seconds = time_program(compiled, x, w, iters=iters)
            yield {"scheme": name, "m": m, "gemm": classify(compiled.as_text()),
                   "us": seconds * 1e6,
                   "GB/s": (sum(a.nbytes for a in jax.tree.leaves(w)) / seconds / 1e9)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--m", default="1,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help=f"comma-separated, of: {', '.join(SCHEMES)}")
    ap.add_argument("--out", default=None,
                    help="append the table to this file, each row as it is measured")
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.m.split(",")]
    schemes = [s.strip() for s in args.schemes.split(",")]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        ap.error(f"unknown scheme(s) {unknown}; there are {', '.join(SCHEMES)}")
    lines = [f"matmul [m, {args.k}] @ [{args.k}, {args.n}] {args.dtype} on "
             f"{jax.devices()[0].device_kind}",
             f"{'scheme':<14} {'m':>4} {'gemm':<26} {'us':>9} {'weight GB/s':>11}"]

    def emit(text: str) -> None:  # a run cut short by its time budget keeps its rows
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    emit("\n".join(lines))
    for r in report(args.k, args.n, ms, jnp.dtype(args.dtype), args.iters, schemes):
        emit(f"{r['scheme']:<14} {r['m']:>4} {r['gemm']:<26} {r['us']:>9.1f} "
             f"{r['GB/s']:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
