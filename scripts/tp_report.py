"""What a tensor-parallel step costs in collectives and memory, read from its HLO: a
decode step of Llama-3.1-8B's shapes (or Mixtral-8x7B's, Qwen3-30B-A3B's, DeepSeek-V3's,
Kimi K2's) lowered for CUDA on an abstract mesh of H200s (no GPU and no weights needed;
serving/engine/tp_lowering.py).

    PYTHONPATH=. python scripts/tp_report.py [--tp 8] [--tokens 64] [--quantize int8]
    PYTHONPATH=. python scripts/tp_report.py --model qwen3-30b-a3b --tp 8 --enable-expert-parallel
    PYTHONPATH=. python scripts/tp_report.py --model deepseek-v3 --tp 8 --enable-expert-parallel
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from serving.engine.tp_lowering import CHECKPOINT_FORMS, MODELS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", default="2,8", help="tensor-parallel sizes, comma-separated (the "
                   "engine's TP=1 runs without a mesh and has no collectives)")
    p.add_argument("--tokens", type=int, default=64,
                   help="decode tokens in the step (= requests; one each)")
    p.add_argument("--pages", type=int, default=64, help="page-table width per request")
    p.add_argument("--quantize", default=None, help="weight recipe, e.g. int8 or fp8")
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--model", default="llama-3.1-8b", choices=list(MODELS))
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture of experts: whole experts per device")
    p.add_argument("--layers", type=int, default=0,
                   help="lower the model's first N layers only (0: all of them)")
    args = p.parse_args()
    from serving.engine.mesh import with_expert_parallel
    from serving.engine.tp_lowering import describe, fewer_layers, step_report
    base = MODELS[args.model]()
    if args.layers:
        base = fewer_layers(base, args.layers)
    for n in (int(x) for x in args.tp.split(",")):
        cfg = with_expert_parallel(base, n, args.enable_expert_parallel)
        r = step_report(cfg, n, (args.tokens, args.tokens, args.pages),
                        stored_form=CHECKPOINT_FORMS.get(args.model),
                        quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype)
        print(describe(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
