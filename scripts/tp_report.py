"""What a tensor-parallel step costs in collectives and memory, read from its HLO: a
decode step of Llama-3.1-8B's shapes (or Mixtral-8x7B's, Qwen3-30B-A3B's) lowered for CUDA
on an abstract mesh of H200s (no GPU and no weights needed; serving/engine/tp_lowering.py).

    PYTHONPATH=. python scripts/tp_report.py [--tp 8] [--tokens 64] [--quantize int8]
    PYTHONPATH=. python scripts/tp_report.py --model qwen3-30b-a3b --tp 8 --enable-expert-parallel
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", default="2,8", help="tensor-parallel sizes, comma-separated (the "
                   "engine's TP=1 runs without a mesh and has no collectives)")
    p.add_argument("--tokens", type=int, default=64,
                   help="decode tokens in the step (= requests; one each)")
    p.add_argument("--pages", type=int, default=64, help="page-table width per request")
    p.add_argument("--quantize", default=None, help="weight recipe, e.g. int8 or fp8")
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--model", default="llama-3.1-8b",
                   choices=["llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b"])
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture of experts: whole experts per device")
    args = p.parse_args()
    from serving.engine.mesh import with_expert_parallel
    from serving.engine.tp_lowering import MODELS, describe, step_report
    for n in (int(x) for x in args.tp.split(",")):
        cfg = with_expert_parallel(MODELS[args.model](), n, args.enable_expert_parallel)
        r = step_report(cfg, n, (args.tokens, args.tokens, args.pages),
                        quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype)
        print(describe(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
