"""What structured outputs cost: the token-bitmask fill on the host and its application on
the device per step, at 1, 16 and 64 constrained rows, and the engine's output tok/s with
every stream constrained by a JSON schema against none, on the demo model.

    python scripts/bench_structured.py                  # all three parts
    python scripts/bench_structured.py --parts host,device --rows 1,16,64
    python scripts/bench_structured.py --parts engine --streams 64 --max-tokens 160

host:   GrammarCompiler.fill (llguidance, rows in parallel) + step_bitmask (the step's array),
        per step, each row walking its own random valid document of the schema.
device: the jitted bitmask op alone on f32[R, V] logits, and the whole sampler without a
        bitmask, with one but no row masked, and with every row masked.
engine: LLMEngine.step() over `--streams` requests, all constrained, then none with the same
        token counts per stream: output tok/s,
        median step time while every stream decodes, and how many outputs are valid JSON
        of the schema.
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

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
             "maxItems": 4},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}


def documents(n: int, seed: int = 0) -> list[str]:
    """n valid documents of SCHEMA with strings of random lengths up to their maxLength, so
    the rows of a step sit in different grammar states (one document walked by every row
    measured a tenth of what real sampled outputs cost)."""
    import random
    rng = random.Random(seed)
    chars = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ-'éü"

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(chars) for _ in range(rng.randint(lo, hi)))
    return [json.dumps({"name": text(1, 30), "age": rng.randint(0, 120),
                        "role": rng.choice(["admin", "user", "guest"]),
                        "tags": [text(1, 12) for _ in range(rng.randint(1, 4))],
                        "address": {"city": text(1, 20), "zip": f"{rng.randint(0, 99999):05d}"}})
            for _ in range(n)]


def _median_us(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e6:.0f}"


def without_bounds(schema):
    """The schema with its strings' maxLength dropped (llguidance's slices then cover every
    string state)."""
    if isinstance(schema, dict):
        return {k: without_bounds(v) for k, v in schema.items() if k != "maxLength"}
    return schema


def bench_host(tokenizer, rows: list[int], schema: dict) -> None:
    from serving.core import grammar as g
    from serving.core.request import Request
    from serving.core.sampling_params import SamplingParams
    from serving.core.scheduler import ScheduledRequest
    from serving.core.structured_outputs import StructuredOutputsParams
    compiler = g.GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    so = StructuredOutputsParams(json=schema)
    started = time.perf_counter()
    compiler.get(so)
    print(f"\ncompile (first, uncached): {(time.perf_counter() - started) * 1e3:.1f} ms")
    print("| constrained rows | fill us/step | step array us/step | total us/step |")
    print("|---:|---:|---:|---:|")
    for n in rows:
        docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents(n)]
        reqs = []
        for i in range(n):
            req = Request(str(i), [1], SamplingParams(max_tokens=len(docs[i]) + 1,
                                                      structured_outputs=so))
            req.grammar = compiler.matcher(so)
            reqs.append(req)
        sched = [ScheduledRequest(r, 1, 0, [1], True) for r in reqs]
        fills, arrays = [], []
        for k in range(min(map(len, docs))):  # steps where every row is still constrained
            t0 = time.perf_counter()
            compiler.fill([r.grammar for r in reqs])
            t1 = time.perf_counter()
            g.step_bitmask(sched, n, compiler.width)
            t2 = time.perf_counter()
            fills.append(t1 - t0)
            arrays.append(t2 - t1)
            for r, doc in zip(reqs, docs):
                r.grammar.accept(doc[k])
        total = [a + b for a, b in zip(fills, arrays)]
        print(f"| {n} | {_median_us(fills)} | {_median_us(arrays)} | {_median_us(total)} |",
              flush=True)


def bench_device(vocab: int, rows: list[int], repeats: int, args_random: bool) -> None:
    import jax
    import jax.numpy as jnp
    from serving.engine.input_prep import padding_step
    from serving.engine.sampler import SamplingInputs, sample
    from serving.engine.token_bitmask import apply_token_bitmask
    kind = "sampled (temperature 0.8)" if args_random else "greedy"
    print(f"\n{kind} rows\n| rows R | bitmask op alone us | "
          "sampler, no bitmask input (as before) us | sampler, no row masked us | sampler, masked us |")
    print("|---:|---:|---:|---:|---:|")
    op = jax.jit(apply_token_bitmask)
    W = (vocab + 31) // 32
    for R in rows:
        rng = np.random.default_rng(0)
        logits = jnp.asarray(rng.normal(size=(R, vocab)).astype(np.float32))
        mask = jnp.asarray(rng.integers(-2**31, 2**31 - 1, size=(R, W), dtype=np.int32))
        greedy = padding_step((R, R, 1)).sampling  # a greedy step's sampling arrays
        greedy["history"] = np.full((R, 1), -1, np.int32)  # no row penalised
        if args_random:
            greedy.update(temperature=np.full(R, 0.8, np.float32), any_random=np.bool_(True))
        s_none = SamplingInputs(**{**greedy, "any_masked": np.bool_(False)})
        s_plain = SamplingInputs(**{**greedy, "any_masked": np.bool_(False)}, token_bitmask=mask)
        s_mask = SamplingInputs(**{**greedy, "any_masked": np.bool_(True)}, token_bitmask=mask)
        samp = jax.jit(sample)

        def timed(fn, *args):
            jax.block_until_ready(fn(*args))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times.append(time.perf_counter() - t0)
            return f"{min(times) * 1e6:.0f}"  # the least disturbed run: the machine is shared
        print(f"| {R} | {timed(op, logits, mask)} | {timed(samp, logits, s_none)} "
              f"| {timed(samp, logits, s_plain)} | {timed(samp, logits, s_mask)} |", flush=True)


def bench_engine(model: str | None, streams: int, max_tokens: int) -> None:
    import jsonschema
    from serving.core.config import EngineConfig
    from serving.core.sampling_params import SamplingParams
    from serving.core.structured_outputs import StructuredOutputsParams
    from serving.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=streams, max_model_len=512,
                                    token_buckets=(16, 64, 512), page_buckets=(32,),
                                    progress=False))
    engine.warmup()
    engine.grammar_compiler.get(StructuredOutputsParams(json=SCHEMA))
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Invent a person and describe them as JSON."}],
        tokenize=False, add_generation_prompt=True)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    print(f"\n{streams} streams, prompt {len(prompt)} tokens, max_tokens {max_tokens}, "
          f"temperature 0.8 (seeded)")
    print("| run | output tokens | output tok/s | median decode step ms (all streams running) "
          "| finished 'stop' | valid JSON of the schema |")
    print("|---|---:|---:|---:|---:|---:|")
    so = StructuredOutputsParams(json=SCHEMA)
    # The constrained run first; the free run then makes the same number of tokens per
    # stream (ignore_eos), so both have the same batch sizes step by step.
    texts, reasons, counts, row = _run(engine, "json", prompt, [SamplingParams(
        temperature=0.8, seed=i, max_tokens=max_tokens, structured_outputs=so)
        for i in range(streams)])
    valid = 0
    for text in texts.values():
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    stops = sum(r == "stop" for r in reasons.values())
    print(f"| every stream constrained by the schema | {row} | {stops}/{streams} | "
          f"{valid}/{streams} |", flush=True)
    _, _, _, row = _run(engine, "free", prompt, [SamplingParams(
        temperature=0.8, seed=i, max_tokens=counts[f"json-{i}"], ignore_eos=True)
        for i in range(streams)])
    print(f"| none constrained, same lengths | {row} | | |", flush=True)


def _run(engine, tag, prompt, params):
    """-> (texts, finish reasons, token counts by request id, table cells)."""
    for i, p in enumerate(params):
        engine.add_request(f"{tag}-{i}", prompt, p)
    texts, reasons, counts, steps = {}, {}, {}, []
    started = time.perf_counter()
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outs = engine.step()
        if engine.scheduler.num_running == len(params) and not engine.scheduler.waiting:
            steps.append(time.perf_counter() - t0)
        for o in outs:
            texts[o.request_id] = texts.get(o.request_id, "") + o.new_text
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    seconds = time.perf_counter() - started
    tokens = sum(counts.values())
    step_ms = f"{statistics.median(steps) * 1e3:.1f}" if steps else "-"
    return texts, reasons, counts, f"{tokens} | {tokens / seconds:.1f} | {step_ms}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="host,device,engine")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--model", help="default: the demo model")
    ap.add_argument("--no-bounds", action="store_true",
                    help="host part: the schema without its strings' maxLength")
    args = ap.parse_args()
    parts = args.parts.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    from transformers import PreTrainedTokenizerFast
    from serving.engine.sizing import resolve_model_dir
    model_dir = resolve_model_dir(args.model)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    print(f"model {model_dir}, vocabulary {len(tokenizer)}")
    if "host" in parts:
        bench_host(tokenizer, rows, without_bounds(SCHEMA) if args.no_bounds else SCHEMA)
    if "device" in parts:
        bench_device(len(tokenizer), rows, args.repeats, False)
        bench_device(len(tokenizer), rows, args.repeats, True)
    if "engine" in parts:
        bench_engine(args.model, args.streams, args.max_tokens)


if __name__ == "__main__":
    main()
