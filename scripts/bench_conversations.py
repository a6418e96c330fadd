"""Datasets that look like chat traffic, for scripts/bench_serving.py: synthetic text we
generate, no downloads.

- multi-turn: conversations that all start with one long shared system prompt; each turn
  sends the whole history (system, every earlier user message and the server's own replies)
  plus a new user message, as chat clients do. Conversations run concurrently, their turns
  one after another. TTFT is reported apart for first turns and later turns: a server with a
  prefix cache answers later turns from it.
- few-shot: single requests whose prompts share a long preamble of worked examples (one of
  a few tasks) and end in a question of their own.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

import bench_serving as bs


@dataclass(frozen=True)
class Conversation:
    system: str
    user_turns: list[str]
    output_len: int  # max_tokens per turn


def _text(num_tokens: int, rng, tokenizer, pool) -> str:
    return bs.make_prompt(num_tokens, rng, tokenizer, pool, "words")[0]


def multi_turn_dataset(num_conversations: int, num_turns: int, system_len: int, user_len: int,
                       output_len: int, seed: int, tokenizer=None) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    pool = bs.plain_token_ids(tokenizer) if tokenizer is not None else None
    system = _text(system_len, rng, tokenizer, pool)
    return [Conversation(system, [_text(user_len, rng, tokenizer, pool)
                                  for _ in range(num_turns)], output_len)
            for _ in range(num_conversations)]


def few_shot_dataset(num: int, num_tasks: int, num_examples: int, example_len: int,
                     question_len: int, output_len: int, seed: int,
                     tokenizer=None) -> list[bs.SampleRequest]:
    rng = np.random.default_rng(seed)
    pool = bs.plain_token_ids(tokenizer) if tokenizer is not None else None
    preambles = []
    for t in range(num_tasks):
        examples = [f"Example {i + 1}:\nQ: {_text(question_len, rng, tokenizer, pool)}\n"
                    f"A: {_text(example_len, rng, tokenizer, pool)}\n"
                    for i in range(num_examples)]
        preambles.append(f"Task {t + 1}. Answer like the examples.\n\n" + "\n".join(examples))
    out = []
    for _ in range(num):
        prompt = (preambles[int(rng.integers(num_tasks))]
                  + f"\nQ: {_text(question_len, rng, tokenizer, pool)}\nA:")
        n = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer else \
            len(prompt.split())
        out.append(bs.SampleRequest(prompt, n, output_len))
    return out


def turn_body(model: str, messages: list[dict], output_len: int, *, ignore_eos: bool,
              temperature: float) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": output_len,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def run_conversations(base_url: str, model: str, conversations: list[Conversation], *,
                            max_concurrency: int, ignore_eos: bool = True,
                            temperature: float = 0.0, quiet: bool = False) -> dict:
    """Up to max_concurrency conversations at a time, each turn after the previous reply."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # A new connection per request, as in bench_serving (llama-server drops idle ones).
    connector = aiohttp.TCPConnector(limit=max_concurrency, force_close=True)
    sem = asyncio.Semaphore(max_concurrency)
    turns: list[tuple[int, bs.RequestOutput]] = []  # (turn number, its output)

    async def converse(session, conv: Conversation) -> None:
        async with sem:
            messages = [{"role": "system", "content": conv.system}]
            for k, user in enumerate(conv.user_turns):
                messages.append({"role": "user", "content": user})
                body = turn_body(model, messages, conv.output_len, ignore_eos=ignore_eos,
                                 temperature=temperature)
                out = await bs.send_request(session, url, body, 0)
                turns.append((k, out))
                if not out.success:
                    return
                messages.append({"role": "assistant", "content": out.text})

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(converse(session, c) for c in conversations))
        duration = time.perf_counter() - start
    outputs = [o for _, o in turns]
    result = bs.summarize(outputs, duration)
    for name, keep in (("first_turn", lambda k: k == 0), ("later_turns", lambda k: k > 0)):
        ttfts = [o.ttft for k, o in turns if o.success and keep(k)]
        result[f"median_ttft_{name}_ms"] = float(np.median(ttfts)) * 1000 if ttfts else 0.0
    result |= {"base_url": base_url, "endpoint": "/v1/chat/completions", "model": model,
               "num_prompts": len(outputs), "num_conversations": len(conversations),
               "max_concurrency": max_concurrency,
               "errors": [o.error for o in outputs if not o.success][:10]}
    if not quiet:
        print(bs.format_report(result), flush=True)
        print(f"{'Median TTFT, first turns (ms):':<40}{result['median_ttft_first_turn_ms']:.2f}")
        print(f"{'Median TTFT, later turns (ms):':<40}{result['median_ttft_later_turns_ms']:.2f}")
    return result
