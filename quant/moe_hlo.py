"""Whether a mixture of experts' grouped matmuls, as a GPU program, do the work of every row
against every expert (docs/architecture.md, "Mixture of experts").

Where it is decided. jax 0.11.2 lowers `jax.lax.ragged_dot` for CUDA to one
`chlo.ragged_dot` (jax/_src/lax/lax.py, `_ragged_dot_general_lower`; the Pallas lowering
behind `jax_ragged_dot_use_gpu_pallas_triton_lowering` is not in the 0.11.2 wheel: turning it
on fails with "No module named 'jax._src.lax.pallas_lowerings'"), and XLA's HLO before
optimization keeps it as one `ragged-dot`. So the lowered program decides nothing: XLA:GPU's
compile passes do. For an H200, jaxlib 0.11.2's rewrite it: the rows are masked and expanded
to [rows, E, in] (a `loop_transpose_fusion`) and one Triton GEMM fusion (a `dot`) multiplies
them, as [rows, E * in] split over K, by every expert's weight: E times the work, and a
temporary of rows x E x in (1.8 GiB for 64 tokens at DeepSeek-V3's shape). With
`--xla_gpu_experimental_use_ragged_dot_fusion=true` the same.

Those passes run without a GPU where the CUDA PJRT plugin is importable (XLA's compiler,
deviceless, for the H200 target of scripts/capture_gpu_hlo.py; nothing autotuned):
`inspect(..., compile=True)` reads the optimized HLO. Without it, `inspect` reads the lowered
StableHLO: a `chlo.ragged_dot` left to XLA:GPU is `dense=None` (undecided), our Pallas kernel
one Triton custom call per projection with no dot at all.

    PYTHONPATH=/tmp/cudaplug:. python -m quant.moe_hlo --tokens 64 --hidden 7168 \\
        --intermediate 2048 --experts 256 [--backend ragged_dot] [--compile]
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
TRITON_CALL = "__gpu$xla.gpu.triton"
# The ops that can carry a grouped matmul's work, in the lowered (StableHLO) or compiled
# (HLO) text.
OPS = {"chlo.ragged_dot": r'"chlo\.ragged_dot"', "stablehlo.dot_general": r"stablehlo\.dot_general",
       "ragged-dot": r"\bragged-dot\(", "dot": r"\sdot\(", TRITON_CALL: re.escape(TRITON_CALL)}


@dataclass(frozen=True)
class Report:
    stage: str  # "lowered" (StableHLO for CUDA) or "compiled" (XLA:GPU's optimized HLO)
    ops: dict[str, int]  # OPS found -> how many
    work: float  # the dots' multiply-adds over the grouped matmuls' own (rows x in x out)
    dense: bool | None  # a dot over every expert; None: a ragged dot left for XLA:GPU

    def describe(self) -> str:
        dense = {True: "dense over every expert", False: "not dense",
                 None: "undecided (a ragged dot left for XLA:GPU's compile)"}[self.dense]
        ops = ", ".join(f"{n} x{c}" for n, c in self.ops.items()) or "none"
        return f"{self.stage}: {ops}; dots do {self.work:.2f}x the grouped work: {dense}"


def _dims(text: str) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text)]


def dot_macs(text: str) -> list[int]:
    """The multiply-adds of every dot in a StableHLO (`stablehlo.dot_general`) or HLO (`dot`)
    module's text: the result's elements times the contracted size."""
    macs = []
    shapes = dict(re.findall(r"%?([\w.\-]+) = \w+\[([\d,]*)\]", text))  # HLO: name -> dims
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            tensors = re.findall(r"tensor<((?:\d+x)*)\w+>", line.split(" : ")[-1])
            lhs, out = _dims(tensors[0]), _dims(tensors[-1])
            contract = re.search(r"(?:contracting_dims = |lhs_contracting_dimensions = )"
                                 r"\[([\d, ]*)\]", line)
        elif m := re.search(r"= \w+\[([\d,]*)\]\S* dot\(%?([\w.\-]+),", line):
            out, lhs = _dims(m.group(1)), _dims(shapes.get(m.group(2), ""))
            contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        else:
            continue
        k = math.prod(lhs[int(d)] for d in _dims(contract.group(1))) if contract else 1
        macs.append(math.prod(out) * k)
    return macs


def read(text: str, stage: str, rows: int, experts: int, projections) -> Report:
    """A Report on a program whose grouped matmuls are `projections` ((in, out) each) over
    `rows` sorted rows and `experts` experts. Dense: its dots do at least half of every row
    against every expert (and more than twice the grouped work, for tiny E)."""
    own = sum(rows * k * n for k, n in projections)
    work = sum(dot_macs(text)) / own
    ops = {name: n for name, pattern in OPS.items() if (n := len(re.findall(pattern, text)))}
    dense = work >= max(2.0, experts / 2)
    if not dense and stage == "lowered" and "chlo.ragged_dot" in ops:
        dense = None
    return Report(stage, ops, work, dense)


def compile_only_device():
    """An H200 for XLA:GPU's compiler without a GPU (scripts/capture_gpu_hlo.py), or None
    where the CUDA PJRT plugin is not importable."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return None
    from pathlib import Path

    from jax._src import xla_bridge
    target = (Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu_hlo"
              / "h200_target_config.txtpb")
    topology = xla_bridge.make_pjrt_topology("cuda", "", target_config=target.read_text(),
                                             topology="1x1x1")
    return topology._make_compile_only_devices()[0]


def expert_mlp(backend: str):
    """rows [M, H] sorted by expert -> [M, H] through each row's expert's gated MLP, gate and
    up joined ([E, H, 2I]) then down ([E, I, H]): the MoE block's grouped matmuls."""
    from quant.ops import grouped_matmul

    def mlp(rows, group_sizes, w_gu, w_down):
        gate, up = jnp.split(grouped_matmul(rows, w_gu, group_sizes, backend), 2, axis=-1)
        return grouped_matmul(jax.nn.silu(gate) * up, w_down, group_sizes, backend)
    return mlp


def lower_for_cuda(fn, *args, device=None):
    """fn lowered for CUDA on this host (an abstract H200: docs/architecture.md, "Kernels
    and their references"), args placed on `device` (a compile-only H200) where given."""
    if device is not None:
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=sharding), args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                      abstract_device=H200)):
            traced = jax.jit(fn).trace(*args)
            if device is not None:
                return traced.lower()
            return traced.lower(lowering_platforms=("cuda",))


def inspect(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int = 8,
            dtype="bfloat16", backend: str = "ragged_dot", compile: bool = False) -> Report:
    """The expert MLP of one MoE layer (tokens x top_k rows) through quant.ops.grouped_matmul
    with `backend`, lowered for CUDA; compile: through XLA:GPU's passes too (needs the CUDA
    PJRT plugin, else RuntimeError)."""
    rows = tokens * top_k
    S = jax.ShapeDtypeStruct
    args = (S((rows, hidden), dtype), S((experts,), jnp.int32),
            S((experts, hidden, 2 * intermediate), dtype),
            S((experts, intermediate, hidden), dtype))
    projections = ((hidden, 2 * intermediate), (intermediate, hidden))
    if not compile:
        text = lower_for_cuda(expert_mlp(backend), *args).as_text()
        return read(text, "lowered", rows, experts, projections)
    device = compile_only_device()
    if device is None:
        raise RuntimeError("compiling for a GPU without one needs the CUDA PJRT plugin "
                           "importable (scripts/capture_gpu_hlo.py)")
    text = lower_for_cuda(expert_mlp(backend), *args, device=device).compile().as_text()
    return read(text, "compiled", rows, experts, projections)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768, help="per expert")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="ragged_dot", help="quant.ops.grouped_matmul's")
    p.add_argument("--compile", action="store_true",
                   help="through XLA:GPU's passes (needs the CUDA PJRT plugin)")
    a = p.parse_args(argv)
    r = inspect(a.tokens, a.hidden, a.intermediate, a.experts, a.top_k, a.dtype, a.backend,
                a.compile)
    print(r.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
