"""Compiles the quantized matmuls for an H200 on a machine without a GPU and saves XLA's
optimized HLO, so quant/hlo.py's classifier is tested against what jaxlib really emits.

XLA's GPU compiler runs deviceless given a target description (GpuTargetConfigProto, here
tests/data/gpu_hlo/h200_target_config.txtpb): every HLO pass runs, GEMM fusion included, but
nothing is autotuned (no device to time candidates on), so a fusion keeps XLA's default tile
config and a real GPU may still choose cuBLAS where this shows Triton. The fusion kinds and
custom-call names are the compiler's own either way.

Needs the CUDA PJRT plugin importable, not installed into the project's environment (it is
large, and only this script uses it):

    pip download --no-deps -d /tmp/whl jax-cuda12-pjrt==0.11.2 jax-cuda12-plugin==0.11.2
    for w in /tmp/whl/*.whl; do python -m zipfile -e "$w" /tmp/cudaplug; done
    JAX_PLATFORMS=cpu PYTHONPATH=/tmp/cudaplug:. python scripts/capture_gpu_hlo.py
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from quant.hlo import SCHEMES, classify  # noqa: E402
from quant.ops import matmul  # noqa: E402

DATA = ROOT / "tests" / "data" / "gpu_hlo"


def without_source_locations(text: str) -> str:
    """The module text less where it was traced from (file names, stack frames, op metadata):
    those name this machine's paths and change with every edit of the Python source."""
    text = re.sub(r", metadata=\{[^{}]*\}", "", text)
    out, skipping = [], False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


def compile_only_device(target_config: Path):
    from jax._src import xla_bridge
    topology = xla_bridge.make_pjrt_topology("cuda", "", target_config=target_config.read_text(),
                                             topology="1x1x1")
    return topology._make_compile_only_devices()[0]


def abstract_weight(name: str, k: int, n: int, sharding):
    """The weight as `quant.hlo.weight` builds it, as shapes only."""
    from quant.array import quantize
    spec = SCHEMES[name]
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    if spec is not None:
        w = jax.eval_shape(lambda a: quantize(a, spec[0], spec[1]), w)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--m", default="1,64")
    ap.add_argument("--target-config", type=Path, default=DATA / "h200_target_config.txtpb")
    ap.add_argument("--out", type=Path, default=DATA)
    args = ap.parse_args()
    device = compile_only_device(args.target_config)
    sharding = jax.sharding.SingleDeviceSharding(device)
    for name in SCHEMES:
        w = abstract_weight(name, args.k, args.n, sharding)
        for m in (int(v) for v in args.m.split(",")):
            x = jax.ShapeDtypeStruct((m, args.k), jnp.bfloat16, sharding=sharding)
            text = without_source_locations(jax.jit(matmul).lower(x, w).compile().as_text())
            path = args.out / f"{name.replace(' ', '_')}_m{m}.hlo.txt"
            path.write_text(text)
            print(f"{name:<14} m={m:<4} {classify(text):<28} -> {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
