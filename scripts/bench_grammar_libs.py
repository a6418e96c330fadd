"""Grammar libraries side by side on one tokenizer: compile time and per-step mask time.

Compares llguidance (what xlaserve uses), xgrammar and outlines-core on the same JSON
schema and regex, walking each through the tokens of one valid output and timing the
token-mask fill at every step (one row, numpy int32 bitmask, or the library's own). Only the
libraries that import are measured; xgrammar and outlines-core are not xlaserve
dependencies (install them apart, e.g. `pip install --target DIR --no-deps xgrammar
outlines-core apache-tvm-ffi` and put DIR on PYTHONPATH).

    python scripts/bench_grammar_libs.py                 # the demo model's tokenizer
    python scripts/bench_grammar_libs.py --tokenizer DIR --repeats 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_TEXT = ('{"name":"Ada Lovelace","age":36,"role":"admin","tags":["math","poetry"],'
               '"address":{"city":"London","zip":"12345"}}')
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_TEXT = "555-867-5309 ext. 42"


def _walk(fill, consume, tokens):
    """Fills the mask before each token and consumes it; -> seconds per fill."""
    times = []
    for t in tokens:
        started = time.perf_counter()
        fill()
        times.append(time.perf_counter() - started)
        consume(t)
    started = time.perf_counter()
    fill()  # the last mask (EOS allowed)
    times.append(time.perf_counter() - started)
    return times


def bench_llguidance(tokenizer, vocab, case, repeats):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp
    tok = llguidance.hf.from_tokenizer(tokenizer, vocab)
    kind, spec, text = case
    tokens = tokenizer.encode(text, add_special_tokens=False)
    compiles, fills = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "json"
                   else llguidance.LLMatcher.grammar_from_regex(spec))
        matcher = llguidance.LLMatcher(tok, grammar)
        compiles.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
        mask = lnp.allocate_token_bitmask(1, vocab)
        fills += _walk(lambda: lnp.fill_next_token_bitmask(matcher, mask, 0),
                       lambda t: matcher.consume_token(t), tokens)
        assert matcher.is_accepting(), "the walk did not reach an accepting state"
    return compiles, fills


def bench_xgrammar(tokenizer, vocab, case, repeats):
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    kind, spec, text = case
    tokens = tokenizer.encode(text, add_special_tokens=False)
    compiles, fills = [], []
    for _ in range(repeats):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        started = time.perf_counter()
        compiled = (compiler.compile_json_schema(json.dumps(SCHEMA)) if kind == "json"
                    else compiler.compile_regex(spec))
        matcher = xgr.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - started)
        mask = xgr.allocate_token_bitmask(1, vocab)
        fills += _walk(lambda: matcher.fill_next_token_bitmask(mask),
                       lambda t: matcher.accept_token(t), tokens)
        assert matcher.accept_token(tokenizer.eos_token_id), "not accepting at the end"
    return compiles, fills


def _byte_level_vocabulary(tokenizer):
    """token bytes -> ids for outlines-core, undoing GPT-2's byte-to-unicode spelling."""
    # GPT-2 spells printable bytes as themselves and the others as chr(256 + n).
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled = printable + [256 + n for n in range(256 - len(printable))]
    decode = dict(zip(map(chr, spelled), printable + sorted(set(range(256)) - set(printable))))
    vocab: dict[bytes, list[int]] = {}
    special = set(tokenizer.all_special_ids)
    for piece, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        try:
            key = bytes(decode[c] for c in piece)
        except KeyError:
            key = piece.encode()
        vocab.setdefault(key, []).append(i)
    return vocab


def bench_outlines_core(tokenizer, vocab, case, repeats):
    import outlines_core as oc
    kind, spec, text = case
    tokens = tokenizer.encode(text, add_special_tokens=False)
    vocabulary = oc.Vocabulary(tokenizer.eos_token_id, _byte_level_vocabulary(tokenizer))
    compiles, fills = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        regex = (oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)) if kind == "json"
                 else spec)
        guide = oc.Guide(oc.Index(regex, vocabulary))
        compiles.append(time.perf_counter() - started)
        mask = np.full((1, (vocab + 31) // 32), -1, np.int32)
        fills += _walk(lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4),
                       lambda t: guide.advance(t, return_tokens=False), tokens)
        assert guide.is_finished() or tokenizer.eos_token_id in guide.get_tokens()
    return compiles, fills


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar,
             "outlines-core": bench_outlines_core}
MODULES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


def import_cost(module: str) -> str:
    """Seconds to import the library in a fresh interpreter, and whether it loads torch."""
    import subprocess
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            "print(time.perf_counter() - t, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        return "not installed"
    seconds, torch = proc.stdout.split()
    return f"{float(seconds):.2f} s" + (", imports torch" if torch == "True" else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="a Hugging Face folder; default: the demo model")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast
    if args.tokenizer is None:
        from model import demo
        args.tokenizer = demo.fetch_demo_model(demo.cache_dir() / "test-demo"
                                               / "SmolLM2-135M-Instruct")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer))
    vocab = len(tokenizer)
    cases = {"json schema": ("json", SCHEMA, SCHEMA_TEXT), "regex": ("regex", REGEX, REGEX_TEXT)}
    print(f"tokenizer {args.tokenizer} ({vocab} tokens), {args.repeats} repeats")
    for name, module in MODULES.items():
        print(f"import {name}: {import_cost(module)}")
    print("| library | case | compile ms (median) | mask us per step (median) | p90 | max |")
    print("|---|---|---:|---:|---:|---:|")
    for name, bench in LIBRARIES.items():
        for label, case in cases.items():
            try:
                started = time.perf_counter()
                compiles, fills = bench(tokenizer, vocab, case, args.repeats)
            except ImportError as e:
                print(f"| {name} | {label} | not installed ({e.name}) | | | |")
                break
            us = sorted(f * 1e6 for f in fills)
            print(f"| {name} | {label} | {statistics.median(compiles) * 1e3:.1f} | "
                  f"{statistics.median(us):.0f} | {us[int(0.9 * (len(us) - 1))]:.0f} | "
                  f"{us[-1]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
