"""Greedy chat answers of weight and KV-cache configurations against the same weights as
converted, on the short questions in tests/data/answer_questions.json.

usage: python scripts/eval_answers.py [--model DIR] [--configs auto,none:float32,int8,...]
           [--max-tokens 32] [--show]

Each configuration is `QUANTIZE[:KV_CACHE_DTYPE]` as the CLI takes them (`auto` is what
`xlaserve serve` runs with no flags; `int4:lm_head:float16` is int4 with an int8 head and a
float16 cache; the demo's default cache is float16), or `bfloat16` / `float16` for the
weights cast to that dtype. The reference is `none:float32` (the weights exactly as converted); a
question agrees when a configuration's answer is token for token the reference's, and
"same start" counts answers whose first sentence is the reference's. Every engine runs
with its defaults (buckets, batch size), the questions batched as a server would.
"""
import argparse
import gc
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTIONS = ROOT / "tests" / "data" / "answer_questions.json"
REFERENCE = "none:float32"
KV_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8")
FLOAT_DTYPES = ("bfloat16", "float16")


def engine_options(config: str) -> dict:
    """"int4:lm_head:float16" -> int4 with an int8 head and a float16 cache; "int8" -> int8
    weights and the default cache; "bfloat16" (or "float16") -> the weights cast to it."""
    if config in FLOAT_DTYPES:
        return dict(quantize="none", dtype=config)
    head, _, last = config.rpartition(":")
    if head and last in KV_DTYPES:
        return dict(quantize=head, kv_cache_dtype=last)
    return dict(quantize=config)


def answers(model, config: str, questions: list[str], max_tokens: int) -> list[list[int]]:
    from serving import LLM, SamplingParams
    llm = LLM(model, progress=False, **engine_options(config))
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for q in questions]  # as the server does
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    ids = [r.token_ids for r in out]
    del llm
    gc.collect()
    return ids


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint or HF folder (default: demo)")
    ap.add_argument("--configs", default="auto,int4,int8,fp8,bfloat16,float16,none")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--show", action="store_true", help="print every answer")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from serving.engine.sizing import resolve_model_dir
    questions = json.loads(Path(args.questions).read_text())
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    configs = [REFERENCE] + [c for c in args.configs.split(",") if c and c != REFERENCE]
    print(f"{len(questions)} questions, {args.max_tokens} greedy tokens; reference "
          f"{REFERENCE}", flush=True)
    print("| configuration | agree | same start | first answer |")
    print("|---|---|---|---|")
    ref = None
    for config in configs:
        started = time.perf_counter()
        ids = answers(args.model, config, questions, args.max_tokens)
        texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
        if ref is None:
            ref = (ids, texts)
        agree = sum(a == b for a, b in zip(ids, ref[0]))
        start = sum(first_sentence(a) == first_sentence(b) for a, b in zip(texts, ref[1]))
        print(f"| {config} | {agree}/{len(ids)} | {start}/{len(ids)} | "
              f"{texts[0].strip()[:60]!r} |  ({time.perf_counter() - started:.0f} s)",
              flush=True)
        if args.show:
            for q, t in zip(questions, texts):
                print(f"    {q} -> {t.strip()!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
