"""Speculative decoding's time per output token: speculation off vs on (n-gram lookup or a
draft model), one stream and a few batch sizes, on input-grounded prompts (repeat or edit a
given text) and on free text. Greedy, offline API; prints a Markdown table.
disable_by_batch_size is the default unless given, so a batch above it measures what
speculation costs when it has switched itself off.

    python scripts/bench_spec_decode.py                         # the demo model, n-gram
    python scripts/bench_spec_decode.py --batch 1,4,8,16 --max-tokens 128 --k 4
    python scripts/bench_spec_decode.py --method draft_model    # the demo drafting for itself
    python scripts/bench_spec_decode.py --method draft_model --draft DIR --batch 1,64
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving import LLM, SamplingParams  # noqa: E402

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long "
        "discussion, members agreed to fund the children's section, extend opening hours on "
        "weekends, and replace the heating system before winter. The vote was unanimous.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result += "
        "item.price * item.quantity\n    return result\n")
GROUNDED = [
    f"Repeat the following text exactly.\n\n{TEXT}\n\nRepeated text:\n",
    f"Rename the variable result to acc in this code and print the whole code.\n\n{CODE}\n",
    f"Quote the sentence about the vote from this text.\n\n{TEXT}\n\nQuote:",
]
FREE = ["Write a short story about a lighthouse keeper.",
        "Explain why the sky is blue to a child.",
        "List some ideas for a weekend trip in the mountains."]


def chat(llm: LLM, prompt: str) -> list[int]:
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(prompt)


def tpot(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    """Seconds per output token per stream: `batch` copies of each prompt at once."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    total, tokens = 0.0, 0
    for p in prompts:
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1))  # prefill cached
        started = time.perf_counter()
        out = llm.generate([p] * batch, params)
        total += time.perf_counter() - started
        tokens += max(len(o.token_ids) for o in out)
    return total / max(tokens, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=3)
    ap.add_argument("--lookup-min", type=int, default=1)
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    ap.add_argument("--draft", default=None,
                    help="draft_model: its folder (default: the model itself)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="default: the engine's")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sets", default="input-grounded,free text")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    off = LLM(args.model, progress=False)
    spec = dict(method=args.method, num_speculative_tokens=args.k)
    if args.method == "ngram":
        spec.update(prompt_lookup_max=args.lookup_max, prompt_lookup_min=args.lookup_min)
        how = f"lookup {args.lookup_min}-{args.lookup_max}"
    else:
        spec["model"] = args.draft or str(off.engine.model_dir)
        how = f"draft {spec['model']}"
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    on = LLM(args.model, progress=False, speculative_config=spec)
    sets = {"input-grounded": [chat(off, p) for p in GROUNDED],
            "free text": [chat(off, p) for p in FREE]}
    sets = {name: sets[name] for name in args.sets.split(",")}
    print(f"{args.method}, k={args.k}, {how}, off above "
          f"{on.engine.speculative_config.disable_by_batch_size} running requests, greedy, "
          f"{args.max_tokens} tokens\n")
    print("| prompts | batch | TPOT off ms | TPOT on ms | speed-up | acceptance |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, prompts in sets.items():
        for b in batches:
            stats = on.engine.scheduler.spec_stats.snapshot()
            t_off = tpot(off, prompts, b, args.max_tokens)
            t_on = tpot(on, prompts, b, args.max_tokens)
            now = on.engine.scheduler.spec_stats
            proposed = now.num_draft_tokens - stats.num_draft_tokens
            rate = (now.num_accepted_tokens - stats.num_accepted_tokens) / max(proposed, 1)
            print(f"| {name} | {b} | {1e3 * t_off:.2f} | {1e3 * t_on:.2f} | "
                  f"{t_off / t_on:.2f}x | {100 * rate:.0f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
