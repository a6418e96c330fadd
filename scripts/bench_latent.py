"""Latent attention on this CPU: cache bytes a token and the decode step of a DeepSeek-V2-Lite-
shaped model against a GQA model of about the same attention parameters, at contexts 1k and
8k; then the latent attention kernel alone against its read bound.

    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/bench_latent.py [--layers 4] [--batch 8]

The models are `--layers` layers of V2-Lite's attention (hidden 2048, 16 heads, one
q_proj, kv_lora_rank 512, rope 64, nope 128, v 128) or of a GQA attention with 8 KV heads of
128 (12.6 M parameters a layer against MLA's 13.8 M), each with V2-Lite's dense MLP (10944),
dummy bfloat16 weights and a bfloat16 cache, attention backend "cpu". A step decodes one
token for each of --batch requests at the given context. The kernel rows time the latent
attention of one layer (16 heads, 576-wide latent) and divide the latent bytes it must read
by the time, against this machine's copy bandwidth, and its multiply-adds (16 heads x 576
for the scores and 576 for the values, a key) by the time: with 16 heads on one latent row
the absorbed form does 32 FLOP a byte, so on a CPU it is bound by arithmetic, not reads.
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

from model.batch import Batch  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.kv_cache import KVCache, bytes_per_page  # noqa: E402
from model.runtime_params import prepare_params  # noqa: E402
from model.transformer import forward, init_params  # noqa: E402
from pallas_kernels.benchmark import copy_bandwidth, timed  # noqa: E402

PAGE = 16
COMMON = dict(vocab_size=4096, hidden_size=2048, intermediate_size=10944, num_heads=16,
              dtype="bfloat16", max_position_embeddings=16384)


def configs(layers: int) -> dict[str, ModelConfig]:
    mla = ModelConfig("DeepseekV2ForCausalLM", num_layers=layers, num_kv_heads=1, head_dim=64,
                      kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128,
                      query_scale=192 ** -0.5, **COMMON)
    gqa = ModelConfig("LlamaForCausalLM", num_layers=layers, num_kv_heads=8, head_dim=128,
                      **COMMON)
    return {"MLA (V2-Lite)": mla, "GQA 16/8": gqa}


def decode_batch(batch: int, ctx: int) -> tuple[Batch, int]:
    """One token for each of `batch` requests at position ctx - 1, pages laid end to end."""
    pages = -(-ctx // PAGE)
    table = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    pos = np.full(batch, ctx - 1, np.int32)
    rows = np.arange(batch)
    slots = table[rows, pos // PAGE] * PAGE + pos % PAGE
    b = Batch(jnp.zeros(batch, jnp.int32), jnp.asarray(pos), jnp.asarray(slots),
              jnp.asarray(rows, dtype=jnp.int32), jnp.asarray(table),
              jnp.asarray(rows, dtype=jnp.int32))
    return b, 1 + table.size


def step_ms(cfg: ModelConfig, batch: int, ctx: int, repeats: int) -> float:
    params = prepare_params(init_params(cfg))
    b, num_pages = decode_batch(batch, ctx)
    cache = KVCache.zeros(cfg, num_pages, PAGE, "bfloat16")
    step = jax.jit(lambda p, c, x: forward(p, c, x, cfg, "cpu"), donate_argnums=(1,))
    _, cache = step(params, cache, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        logits, cache = step(params, cache, b)
        logits.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def kernel_rows(batch: int, ctxs: list[int], bandwidth: float) -> list[str]:
    from model.attention import latent_paged_attention
    rows = []
    for ctx in ctxs:
        b, num_pages = decode_batch(batch, ctx)
        rng = np.random.default_rng(0)
        latent = jnp.asarray(rng.normal(size=(1, num_pages, PAGE, 1, 576)), jnp.bfloat16)
        cache = KVCache(latent, jnp.zeros((1, num_pages, PAGE, 1, 0), jnp.bfloat16))
        q = jnp.asarray(rng.normal(size=(batch, 16, 576)), jnp.bfloat16)
        attend = lambda q, c: jnp.pad(  # padded back to q's shape for timed's chain
            latent_paged_attention(q, c, 0, b, 0.1, "cpu", value_dim=512),
            ((0, 0), (0, 0), (0, 64)))
        s = timed(attend, q, cache)
        read = batch * ctx * 576 * 2
        flops = batch * ctx * 16 * 2 * (576 + 576)  # scores, and values over the full row
        rows.append(f"| {batch} x {ctx} | {s * 1e3:.3f} | {read / s / 1e9:.1f} | "
                    f"{100 * read / s / bandwidth:.0f}% | {flops / s / 1e9:.1f} |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ctxs = [int(c) for c in args.contexts.split(",")]
    print(f"decode step, {args.layers} layers, {args.batch} requests, bfloat16, backend cpu")
    print("| model | cache B/token/layer | " + " | ".join(f"step ms @ {c}" for c in ctxs) + " |")
    print("|---|---:|" + "---:|" * len(ctxs))
    for name, cfg in configs(args.layers).items():
        per_token = bytes_per_page(cfg, 1, "bfloat16", num_layers=1)
        times = [step_ms(cfg, args.batch, c, args.repeats) for c in ctxs]
        print(f"| {name} | {per_token} | " + " | ".join(f"{t:.1f}" for t in times) + " |",
              flush=True)
    bandwidth = copy_bandwidth()
    print(f"\nlatent attention, one layer, 16 heads, bfloat16 latent; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s")
    print("| requests x context | ms | latent GB/s | of copy bandwidth | GFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for row in kernel_rows(args.batch, ctxs, bandwidth):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
