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
    XLASERVE_CPU_KERNELS=0 JAX_PLATFORMS=cpu PYTHONPATH=/tmp/cudaplug:. \
        python scripts/capture_gpu_hlo.py --step pallas     # the 8B step's activation peak

(XLASERVE_CPU_KERNELS=0: the host is a CPU, but the program is for the GPU, which has none of
our C++ kernels.)
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from quant.hlo import SCHEMES, classify, quantizer  # noqa: E402
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
    w = jax.eval_shape(quantizer(name), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), w)


def step_peaks(device, backend: str) -> None:
    """The largest step program of a Llama-3.1-8B-shaped bf16 engine, compiled for the target
    with `backend`'s attention: its temporaries, as the memory plan reads them."""
    import time
    from functools import partial

    from bench_decode import LLAMA_8B
    from model import attention
    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from model.runtime_params import prepare_params
    from model.transformer import abstract_params
    from serving.core.buckets import Buckets
    from serving.engine.input_prep import all_step_shapes, history_shape, padding_step
    from serving.engine.runner import _step
    from serving.engine.step_buffers import pack
    from serving.engine.sampler import NUM_TOP_LOGPROBS
    attention.PALLAS_INTERPRET = False
    sharding = jax.sharding.SingleDeviceSharding(device)
    put = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    cfg = ModelConfig.from_hf(LLAMA_8B, "bfloat16")
    params = put(jax.eval_shape(lambda: prepare_params(jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype), abstract_params(cfg)))))
    cache = put(jax.eval_shape(lambda: KVCache.zeros(cfg, 2, 16)))
    kind = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    # (max_num_seqs, max_num_batched_tokens, max_model_len): the defaults at the whole and
    # an 8k context, and bench_decode's batch-256 engine.
    for seqs, tokens, max_len in ((64, 512, 131072), (64, 512, 8192), (256, 4096, 1024)):
        shape = max(all_step_shapes(Buckets.derive(seqs, tokens, max_len, 16), seqs))
        buffers, layout = pack(padding_step(shape))
        history = np.full(history_shape(shape, 16), -1, np.int32)
        bitmask = np.full((shape[1], (cfg.vocab_size + 31) // 32), -1, np.int32)
        started = time.perf_counter()
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                      abstract_device=kind)):
            step = partial(_step, cfg=cfg, backend=backend, layout=layout,
                           num_top=NUM_TOP_LOGPROBS, vocab_size=cfg.vocab_size)
            compiled = jax.jit(step, donate_argnums=(1,)).lower(
                params, cache, put(buffers), put(history), put(bitmask),
                put(np.zeros(shape[1], np.int32))).compile()
        m = compiled.memory_analysis()
        print(f"8B step {shape} ({backend}): temporaries {m.temp_size_in_bytes / 2**30:.3f} GiB, "
              f"compiled in {time.perf_counter() - started:.0f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--m", default="1,64")
    ap.add_argument("--target-config", type=Path, default=DATA / "h200_target_config.txtpb")
    ap.add_argument("--out", type=Path, default=DATA)
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help=f"comma-separated, of: {', '.join(SCHEMES)}")
    ap.add_argument("--step", default=None, metavar="BACKEND",
                    help="instead: the 8B engine's largest step programs with this attention "
                         "backend (pallas, pallas_pages), their temporaries")
    args = ap.parse_args()
    device = compile_only_device(args.target_config)
    if args.step:
        step_peaks(device, args.step)
        return 0
    sharding = jax.sharding.SingleDeviceSharding(device)
    for name in (s.strip() for s in args.schemes.split(",")):
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
