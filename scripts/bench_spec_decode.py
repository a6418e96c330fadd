"""Speculative decoding's time per output token: speculation off vs on (n-gram lookup or a
draft model), one stream and a few batch sizes, on input-grounded prompts (repeat or edit a
given text) and on free text. Greedy, offline API; prints a Markdown table.
disable_by_batch_size is the default unless given, so a batch above it measures what
speculation costs when it has switched itself off.

    python scripts/bench_spec_decode.py                         # the demo model, n-gram
    python scripts/bench_spec_decode.py --batch 1,4,8,16 --max-tokens 128 --k 4 --lookup-min 1
    python scripts/bench_spec_decode.py --method draft_model    # the demo drafting for itself
    python scripts/bench_spec_decode.py --method draft_model --draft DIR --batch 1,64
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
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


def chat_text(llm: LLM, prompt: str) -> str:
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       add_generation_prompt=True, tokenize=False)
    return prompt


def chat(llm: LLM, prompt: str) -> list[int]:
    return llm.tokenizer.encode(chat_text(llm, prompt), add_special_tokens=False)


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


def llama_tpot(binary: str, args: list[str], texts: list[str], max_tokens: int) -> float:
    """llama-server's own mean ms per generated token (its `timings`) over the prompts,
    greedy, prompt cache off; the server runs with `args` (model and speculative flags)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([binary, *args, "--port", str(port), "--host", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        ms, tokens = 0.0, 0
        for i, text in enumerate([texts[0]] + texts):  # the first is a warm-up
            body = json.dumps(dict(prompt=text, n_predict=max_tokens, temperature=0.0,
                                   cache_prompt=False)).encode()
            req = urllib.request.Request(url + "/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                t = json.loads(r.read())["timings"]
            if i:
                ms += t["predicted_ms"]
                tokens += t["predicted_n"]
        return ms / 1e3 / max(tokens, 1)
    finally:
        server.terminate()
        server.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    ap.add_argument("--draft", default=None,
                    help="draft_model: its folder (default: the model itself)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="default: the engine's")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sets", default="input-grounded,free text")
    ap.add_argument("--llama-server", default=None,
                    help="also time this llama-server binary at one stream (needs --gguf)")
    ap.add_argument("--gguf", default=None, help="the GGUF file llama-server serves")
    ap.add_argument("--llama-args", default="--threads 2",
                    help="flags for every llama-server run")
    ap.add_argument("--llama-spec", default="none;--spec-type ngram-simple",
                    help="';'-separated llama-server speculative settings ('none': off)")
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
    texts = {"input-grounded": [chat_text(off, p) for p in GROUNDED],
             "free text": [chat_text(off, p) for p in FREE]}
    texts = {name: texts[name] for name in args.sets.split(",")}
    sets = {name: [off.tokenizer.encode(t, add_special_tokens=False) for t in ts]
            for name, ts in texts.items()}
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
    if args.llama_server:
        print("\n| prompts | llama-server speculative setting | TPOT ms | our TPOT (on) / theirs "
              "|\n|---|---|---:|---:|")
        for name, prompts in sets.items():
            ours = tpot(on, prompts, 1, args.max_tokens)
            for setting in args.llama_spec.split(";"):
                extra = [] if setting.strip() == "none" else setting.split()
                t = llama_tpot(args.llama_server, ["-m", args.gguf, *args.llama_args.split(),
                                                   *extra], texts[name], args.max_tokens)
                print(f"| {name} | {setting.strip()} | {1e3 * t:.2f} | {ours / t:.2f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
