"""Is a step cheaper to compile as two stages? The default configuration's step programs (one
per token bucket: embed -> layers -> norm -> logits -> sampler) against a backbone program
per token bucket (embed -> layers -> norm, the sampled rows' hidden states out) plus a head
program per request bucket (logits -> sampler), on the demo model, this machine.

    python scripts/bench_stages.py [--repeats 30] [--skip-compile]

Reports each program's trace + lower + compile seconds (one at a time, so the sums are the
work a warm-up does; it runs them 2 at a time), the programs' counts, and the cost of the
second dispatch: the median time of a decode step at 1, 16 and 64 tokens as one program
against the two stages back to back (the hidden rows stay on the device between them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.transformer import compute_logits, forward_hidden  # noqa: E402
from serving.core.config import EngineConfig  # noqa: E402
from serving.engine.input_prep import padding_step  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.engine.runner import split_batch  # noqa: E402
from serving.engine.step_buffers import pack, unpack  # noqa: E402
from serving.engine.sampler import SamplingInputs, sample  # noqa: E402


def backbone(params, cache, buffers, *, layout, cfg, backend):
    batch, _ = unpack(buffers, layout)
    batch = split_batch(batch)[0]
    hidden, cache = forward_hidden(params, cache, batch, cfg, backend)
    return hidden[batch.logits_indices], cache


def head(params, rows, buffers, history, bitmask, *, layout, cfg, num_top, vocab_size):
    _, sampling = unpack(buffers, layout)
    sampling["history"] = history
    logits = compute_logits(params, rows, cfg)[:, :vocab_size]
    return sample(logits, SamplingInputs(**sampling, token_bitmask=bitmask), num_top)


def sampling_only(arrays):
    """The step's arrays with the batch part emptied: the head's own (per request bucket)."""
    return type(arrays)(arrays.shape, {}, arrays.sampling, arrays.wants_logprobs)


def timed_compile(fn, *args, **kw) -> tuple[object, float]:
    t0 = time.perf_counter()
    program = fn.lower(*args, **kw).compile()
    return program, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(progress=False))
    r = engine.runner
    cfg = r.cfg
    shapes = engine.step_shapes
    print(f"default configuration: {len(shapes)} step shapes {shapes}")
    static = dict(cfg=cfg, backend=r.backend)
    full_fn = r._jitted
    bb_fn = jax.jit(partial(backbone, **static), donate_argnums=(1,),
                    static_argnames=("layout",))
    hd_fn = jax.jit(partial(head, cfg=cfg, num_top=r.max_logprobs, vocab_size=r.vocab_size),
                    static_argnames=("layout",))

    full, bb, hd, t_full, t_bb, t_hd = {}, {}, {}, {}, {}, {}
    print("\n| program | shape | compile s |\n|---|---|---:|")
    for shape in shapes:
        ex = padding_step(shape)
        buffers, layout = pack(ex)
        full[shape], t_full[shape] = timed_compile(
            full_fn, r.params, r.cache, buffers, r._history(ex), r._bitmask(ex), layout=layout)
        print(f"| whole step | {shape} | {t_full[shape]:.2f} |", flush=True)
    for shape in shapes:
        ex = padding_step(shape)
        buffers, layout = pack(ex)
        bb[shape], t_bb[shape] = timed_compile(bb_fn, r.params, r.cache, buffers, layout=layout)
        print(f"| backbone | {shape} | {t_bb[shape]:.2f} |", flush=True)
    for R in sorted({s[1] for s in shapes}):
        shape = next(s for s in shapes if s[1] == R)
        ex = padding_step(shape)
        hb, hl = pack(sampling_only(ex))
        rows, r.cache = bb[shape](r.params, r.cache, jax.device_put(pack(ex)[0]))
        hd[R], t_hd[R] = timed_compile(hd_fn, r.params, rows, hb, r._history(ex),
                                       r._bitmask(ex), layout=hl)
        print(f"| head | R={R} | {t_hd[R]:.2f} |", flush=True)
    whole, staged = sum(t_full.values()), sum(t_bb.values()) + sum(t_hd.values())
    print(f"\nwhole steps: {len(full)} programs, {whole:.1f} s; stages: {len(bb)} backbones + "
          f"{len(hd)} heads = {len(bb) + len(hd)} programs, {staged:.1f} s "
          f"(backbones {sum(t_bb.values()):.1f} s, heads {sum(t_hd.values()):.1f} s)")

    print("\n| decode step, T tokens | whole step ms (median) | two stages ms (median) | "
          "difference ms |\n|---:|---:|---:|---:|")
    for T in (1, 16, 64):
        shape = next(s for s in shapes if s[0] >= T)
        ex = padding_step(shape)
        buffers, layout = pack(ex)
        hb, hl = pack(sampling_only(ex))
        hist, mask = r._history(ex), r._bitmask(ex)

        def one():
            out, _, r.cache = full[shape](r.params, r.cache, jax.device_put(buffers), hist, mask)
            return np.asarray(out.tokens)

        def two():
            rows, r.cache = bb[shape](r.params, r.cache, jax.device_put(buffers))
            return np.asarray(hd[shape[1]](r.params, rows, jax.device_put(hb), hist,
                                           mask).tokens)
        times = {one: [], two: []}
        for f in (one, two):
            f()
        for _ in range(args.repeats):  # interleaved: drift hits both alike
            for f in (one, two):
                t0 = time.perf_counter()
                f()
                times[f].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[f]) * 1e3 for f in (one, two))
        print(f"| {shape[0]} | {a:.2f} | {b:.2f} | {b - a:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
