"""Quality of quantized weights and KV caches: perplexity on a fixed text and greedy agreement
with the unquantized model, as a table.

usage: python scripts/eval_quality.py [--model DIR] [--dtype float32|bfloat16]
           [--weights none,int8,fp8] [--kv-cache-dtypes int8,fp8]

Rows: each weight recipe with the model-dtype KV cache, then unquantized weights with each
quantized KV-cache dtype. With no --model, the demo model (SmolLM2-135M-Instruct).
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "data"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint or HF folder (default: demo)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ap.add_argument("--weights", default="none,int8,fp8",
                    help="comma-separated recipes (none, int8, fp8, fp8:channel, int8:embed ...)")
    ap.add_argument("--kv-cache-dtypes", default="int8,fp8",
                    help="comma-separated quantized KV-cache dtypes, with unquantized weights")
    ap.add_argument("--text", default=str(DATA / "paged_kv_essay.txt"))
    ap.add_argument("--prompts", default=str(DATA / "quality_prompts.json"))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=512, help="perplexity context, in tokens")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from model.checkpoint import load_model
    from model.quality import evaluate
    from serving.engine.sizing import resolve_model_dir
    model_dir = resolve_model_dir(args.model)
    cfg, params = load_model(model_dir, args.dtype, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokens = tokenizer.encode(Path(args.text).read_text())
    prompts = [tokenizer.encode(p) for p in json.loads(Path(args.prompts).read_text())]
    weights = [w for w in args.weights.split(",") if w]
    kvs = [k for k in args.kv_cache_dtypes.split(",") if k and k != "auto"]
    configs = [(w, "auto") for w in weights] + [("none", k) for k in kvs]
    if configs[0] != ("none", "auto"):
        configs.insert(0, ("none", "auto"))  # the reference every row is compared with
    print(f"model {model_dir} ({cfg.dtype}); text {Path(args.text).name}: {len(tokens)} tokens, "
          f"windows of {args.window}; {len(prompts)} prompts x {args.max_new_tokens} greedy "
          "tokens", flush=True)
    started = time.perf_counter()
    evaluate(cfg, params, tokens, prompts, configs, max_new_tokens=args.max_new_tokens,
             window=args.window, log=lambda s: print(s, flush=True))
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
