"""Time a linear-attention hybrid's compiled steps against the dense model of the same widths.

Three models of one size (hidden 1024, 24 layers, attention of 8 heads x 128 with 2 KV
heads, an MLP of 3072, random float32 weights prepared as the engine prepares them):
- dense: Qwen3's layer 24 times;
- Gated DeltaNet 3:1: Qwen3.5's layout, three linear layers (4 key heads, 8 value heads,
  128 wide: Qwen3.5-9B's heads at a quarter of its width) to one gated attention layer;
- Mamba2: Nemotron-H's layout, 48 blocks: 24 mixers, one in eight attention (3) and the
  others Mamba2 (21: 32 heads x 64, a state of 128 in 8 groups), each followed by an MLP
  block (squared ReLU, ungated), so the model holds about the dense one's parameters.

Shapes, as scripts/bench_step.py names them (TOKENSxROWSxPAGES, pages of 16): decode steps of
1 and 16 requests at --context, and one request's prefill chunks of 256 and 1024 tokens from
position 0. The recurrent state of every request is read and written in each step. The
models' steps run in turns, so a load that comes and goes falls on all of them alike.

    python scripts/bench_hybrid_step.py
    python scripts/bench_hybrid_step.py --shapes 1x1x64,256x1x16 --repeats 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.config import ModelConfig  # noqa: E402
from model.runtime_params import prepare_params  # noqa: E402
from model.transformer import abstract_params  # noqa: E402
from scripts.bench_step import Stepper  # noqa: E402

COMMON = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072,
              num_attention_heads=8, num_key_value_heads=2, head_dim=128,
              max_position_embeddings=8192, rms_norm_eps=1e-6, torch_dtype="float32")
MODELS = {
    "dense": dict(COMMON, architectures=["Qwen3ForCausalLM"], num_hidden_layers=24),
    "gated deltanet 3:1": dict(
        COMMON, architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=24,
        full_attention_interval=4, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=128, linear_value_head_dim=128),
    "mamba2 (nemotron-h)": dict(
        COMMON, architectures=["NemotronHForCausalLM"],
        hybrid_override_pattern="".join("*-" if i % 8 == 7 else "M-" for i in range(24)),
        mamba_num_heads=32,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128,
        mlp_hidden_act="relu2"),
}


def random_params(cfg: ModelConfig, scale: float = 0.02):
    """Small random weights drawn on the host (init_params compiles one program for the
    whole tree, minutes for a model whose layers differ)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: (rng.standard_normal(s.shape, np.float32) * scale
                                   ).astype(s.dtype), abstract_params(cfg))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None,
                   help="comma-separated TOKENSxROWSxPAGES (default: decode of 1 and 16 "
                        "requests at --context, prefill chunks of 256 and 1024)")
    p.add_argument("--context", type=int, default=1024, help="decode position + 1")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--attention-backend", default="cpu")
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated, of: " + ", ".join(MODELS))
    args = p.parse_args()
    pages = -(-args.context // args.page_size)
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else [(1, 1, pages), (16, 16, pages), (256, 1, 16),
                                   (1024, 1, 64)])
    names = args.models.split(",")
    steppers = {name: Stepper(cfg, prepare_params(random_params(cfg)), shapes,
                              args.attention_backend, args)
                for name, cfg in ((n, ModelConfig.from_hf(MODELS[n])) for n in names)}
    for name, s in steppers.items():
        cfg = s.cfg
        print(f"# {name}: {cfg.num_layers} layers, {cfg.num_kv_layers} with K/V pages, "
              f"{cfg.num_linear_layers} with a recurrent state", flush=True)
    best = {name: {} for name in names}
    compile_s = {name: {} for name in names}
    for shape in shapes:
        compiled = {name: s.compile(shape) for name, s in steppers.items()}
        times = {name: [] for name in names}
        for _ in range(args.repeats):
            for name, s in steppers.items():
                times[name].append(s.run(*compiled[name][:2]))
        for name in names:
            best[name][shape], compile_s[name][shape] = min(times[name]), compiled[name][2]
        print(f"# {'x'.join(map(str, shape))} done", flush=True)
    print(f"\nrandom float32 weights, attention={args.attention_backend}, best of "
          f"{args.repeats}; ms per step (tokens/s), compile seconds in brackets\n")
    print("| shape (tokens x rows x pages) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for shape in shapes:
        cells = [f"{best[n][shape] * 1e3:.1f} ({shape[0] / best[n][shape]:.0f}) "
                 f"[{compile_s[n][shape]:.0f}]" for n in names]
        print(f"| {'x'.join(map(str, shape))} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
