"""KV memory of hybrid models (window and full-attention layers): one page table for every
layer against the window layers on a pool of their own (docs/architecture.md, "Sliding
windows and hybrid KV").

Measured: a Gemma-3-shaped model (5 window layers to 1 full, random weights) decodes
--requests requests together to --context tokens, 16x its window; the script reads the
pages each pool holds at the end of the run and compares the bytes with what one shared
table holds for the same requests (every page of every layer).

Planned: for published shapes (Gemma 3 27B, Gemma 2 9B, gpt-oss-20b, bfloat16 K/V, pages of
16 tokens) the KV bytes one request holds at a few context lengths, and how many such
requests --kv-gib of KV memory holds, both ways (the engine's own sizing arithmetic).

    python scripts/bench_hybrid_kv.py
    python scripts/bench_hybrid_kv.py --requests 8 --context 2048 --window 128
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1 << 30
# name: (layers, window layers, KV heads, head dim, window), from the models' config.json
SHAPES = {
    "gemma-3-27b": (62, 52, 16, 128, 1024),
    "gemma-2-9b": (42, 21, 8, 256, 4096),
    "gpt-oss-20b": (24, 12, 8, 64, 128),
}


def measured(args) -> None:
    import transformers as tf

    from model.kv_cache import bytes_per_page
    from model.kv_groups import num_group_layers
    from serving import LLM, SamplingParams
    from serving.core.scheduler import cdiv

    ps = args.page_size
    folder = Path(tempfile.mkdtemp(prefix="hybrid-kv-"))
    tf.Gemma3TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, sliding_window=args.window,
                        max_position_embeddings=args.context + 64).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), load_format="dummy", max_num_seqs=args.requests,
              max_model_len=args.context + 16, page_size=ps, progress=False)
    engine = llm.engine
    kvm = engine.scheduler.kv_cache_manager
    full_layers, window_layers = num_group_layers(engine.cfg)
    held = {"full": 0, "window": 0}
    allocate = kvm.allocate_slots

    def watched(req, n, hit=None):  # the pages held once the last step is scheduled
        ok = allocate(req, n, hit)
        if req.num_tokens >= args.context - 1:
            held["full"] = max(held["full"], kvm.full.allocator.num_used_pages)
            held["window"] = max(held["window"], kvm.window.allocator.num_used_pages)
        return ok
    kvm.allocate_slots = watched
    prompts = [[(7 * i + r) % 500 + 3 for i in range(32)] for r in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.context - 32, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    kv = engine.runner.kv_cache_dtype
    full_b = bytes_per_page(engine.cfg, ps, kv, full_layers)
    win_b = bytes_per_page(engine.cfg, ps, kv, window_layers)
    one_table = args.requests * cdiv(args.context, ps) * (full_b + win_b)
    two_pools = held["full"] * full_b + held["window"] * win_b
    print(f"measured: 12 layers ({window_layers} window of {args.window}, {full_layers} full), "
          f"{args.requests} requests decoded together to {args.context} tokens "
          f"({seconds:.1f} s)")
    print("| | pages held (full / window) | KV bytes held | per request |")
    print("|---|---:|---:|---:|")
    print(f"| one table | {args.requests * cdiv(args.context, ps)} (every layer) | "
          f"{one_table / 2**20:.2f} MiB | {one_table / args.requests / 2**20:.2f} MiB |")
    print(f"| two pools | {held['full']} / {held['window']} | {two_pools / 2**20:.2f} MiB | "
          f"{two_pools / args.requests / 2**20:.2f} MiB |")
    print(f"ratio: {one_table / two_pools:.2f}x less KV held; window pool "
          f"{engine.window_num_pages - 1} pages, full pool {engine.num_pages - 1}")


def planned(args) -> None:
    from serving.core.kv_window import cdiv
    ps, budget = 16, args.kv_gib * GIB
    print(f"\nplanned: bfloat16 K/V, pages of {ps} tokens, {args.kv_gib} GiB of KV memory")
    print("| model | context | one table: GiB / request | requests | two pools: GiB / "
          "request | requests |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (layers, window_layers, heads, dim, window) in SHAPES.items():
        per_layer_page = 2 * ps * heads * dim * 2
        full_layers = layers - window_layers
        for context in (8192, 32768, 131072):
            one = cdiv(context, ps) * layers * per_layer_page
            window_pages = min(cdiv(context, ps), cdiv(window - 1, ps) + 2)
            two = (cdiv(context, ps) * full_layers + window_pages * window_layers) \
                * per_layer_page
            print(f"| {name} | {context} | {one / GIB:.2f} | {budget // one} | "
                  f"{two / GIB:.2f} | {budget // two} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-gib", type=int, default=100, help="KV memory for the planned table")
    args = p.parse_args()
    measured(args)
    planned(args)


if __name__ == "__main__":
    main()
