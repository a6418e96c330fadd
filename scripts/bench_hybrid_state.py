"""Memory a request holds on a linear-attention hybrid against a dense model of its size
(docs/architecture.md, "Linear attention and recurrent state"), by the engine's own
arithmetic: `slot_bytes` for the recurrent state, `bytes_per_page` for the attention layers'
K/V, and the GPU memory plan for how many requests of a given context one H200 holds.

Shapes are the published config.json's (bfloat16 weights and K/V, float32 state, pages of
16 tokens); the weights' bytes are counted from the shapes, the activation peak is taken as
--activation-gib (a compiled step's is measured on the GPU itself).

    python scripts/bench_hybrid_state.py
    python scripts/bench_hybrid_state.py --contexts 1024 8192 32768 131072
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB, MIB = 1 << 30, 1 << 20
H200_BYTES = 141 * 10 ** 9
PAGE = 16
# config.json fields (the ones our config reads), published checkpoints
QWEN3_5_9B = dict(
    architectures=["Qwen3_5ForCausalLM"], vocab_size=248320, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, mamba_ssm_dtype="float32", max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    dtype="bfloat16")
QWEN3_8B = dict(  # the dense model of about its size
    architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, dtype="bfloat16")
QWEN3_NEXT_80B = dict(
    architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512,
    num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    norm_topk_prob=True, max_position_embeddings=262144, dtype="bfloat16")
NEMOTRON_H_8B = dict(  # 24 Mamba2, 4 attention and 24 MLP blocks, interleaved
    architectures=["NemotronHForCausalLM"], vocab_size=131072, hidden_size=4096,
    intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    hybrid_override_pattern=("M-" * 5 + "M*-") * 4, mamba_num_heads=128,
    mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=256,
    layer_norm_epsilon=1e-5, max_position_embeddings=8192, dtype="bfloat16")
MODELS = {"Qwen3.5-9B": QWEN3_5_9B, "Qwen3-8B (dense)": QWEN3_8B,
          "Qwen3-Next-80B-A3B": QWEN3_NEXT_80B, "Nemotron-H-8B": NEMOTRON_H_8B}


def weight_bytes(cfg) -> int:
    import jax
    import numpy as np

    from model.transformer import abstract_params
    leaves = jax.tree.leaves(abstract_params(cfg))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in leaves)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--activation-gib", type=float, default=4.0)
    args = ap.parse_args()
    from model.config import ModelConfig
    from model.kv_cache import bytes_per_page
    from model.linear_attention.state import slot_bytes
    from serving.engine.memory_plan import MemoryPlanError, plan_memory

    print("| model | weights (GiB) | state a request (MiB) | K/V a token (KiB) | "
          + " | ".join(f"held at {c} (MiB)" for c in args.contexts) + " | "
          + " | ".join(f"requests of {c} on an H200" for c in args.contexts) + " |")
    print("|---|" + "---:|" * (3 + 2 * len(args.contexts)))
    for name, hf in MODELS.items():
        cfg = ModelConfig.from_hf(hf)
        state = slot_bytes(cfg) if cfg.num_linear_layers else 0
        page = bytes_per_page(cfg, PAGE)
        weights = weight_bytes(cfg)
        held, fits = [], []
        for c in args.contexts:
            pages = -(-c // PAGE)
            held.append((state + pages * page) / MIB)
            try:
                plan = plan_memory(device_bytes=H200_BYTES, weight_bytes=weights,
                                   activation_bytes=int(args.activation_gib * GIB),
                                   page_bytes=page, page_size=PAGE, model_max_len=c,
                                   max_model_len=c)
                kv = (plan.num_pages - 1) * page
                # each request's state comes out of the same memory as the pages
                fits.append(str(int(kv // (state + pages * page))))
            except MemoryPlanError:
                fits.append("0")
        print(f"| {name} | {weights / GIB:.1f} | {state / MIB:.1f} | {page / PAGE / 1024:.0f} | "
              + " | ".join(f"{h:.0f}" for h in held) + " | " + " | ".join(fits) + " |")


if __name__ == "__main__":
    main()
