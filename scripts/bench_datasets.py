"""The prompts and arrival times of scripts/bench_serving.py: random token or word prompts of
fixed lengths, synthetic chat prompts, and Poisson / gamma arrival gaps, all seeded. The
datasets that share prefixes (multi-turn, few-shot) are in scripts/bench_conversations.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can out up about into them than some time only other new could these two may first "
    "then do any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three small system water house number part place city model "
    "server token cache batch kernel memory latency question answer explain describe simple"
).split()


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens by the given tokenizer; words when there is none
    output_len: int  # max_tokens


def load_tokenizer(path: str | None):
    if not path:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def plain_token_ids(tokenizer) -> np.ndarray:
    """Ids whose text is printable ASCII and not special: random prompts built from them
    re-tokenize to the same length in any server using the same vocabulary."""
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    ids = [i for i, t in enumerate(texts)
           if i not in special and t.strip() and t.isascii() and t.isprintable()]
    return np.asarray(ids, dtype=np.int64)


def fit_token_length(tokenizer, ids: list[int], length: int, rng, pool) -> tuple[str, int]:
    """Decode ids to text whose re-encoding has exactly `length` tokens (or as close as a few
    rounds of trimming and topping up get)."""
    text = tokenizer.decode(ids)
    for _ in range(8):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] if len(ids) > length else ids + rng.choice(pool, length - len(ids)).tolist()
        text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def words_text(num_words: int, rng) -> str:
    return " ".join(rng.choice(WORDS, num_words).tolist())


def make_prompt(length: int, rng, tokenizer=None, pool=None, style: str = "tokens") -> tuple[str, int]:
    """A prompt of `length` tokens: random plain token ids ("tokens") or random words ("words")."""
    if tokenizer is None:
        return words_text(length, rng), length
    if style == "tokens":
        ids = rng.choice(pool, length).tolist()
    else:
        ids = tokenizer.encode(words_text(length, rng), add_special_tokens=False)[:length]
    return fit_token_length(tokenizer, ids, length, rng, pool)


def random_dataset(num: int, input_len: int, output_len: int, seed: int,
                   tokenizer=None) -> list[SampleRequest]:
    """vLLM's `random` dataset with range ratio 0: fixed lengths, random token ids."""
    rng = np.random.default_rng(seed)
    pool = plain_token_ids(tokenizer) if tokenizer is not None else None
    out = []
    for _ in range(num):
        text, n = make_prompt(input_len, rng, tokenizer, pool, "tokens")
        out.append(SampleRequest(text, n, output_len))
    return out


def chat_lengths(num: int, input_len: int, output_len: int, rng, max_model_len: int,
                 sigma: float = 0.8) -> list[tuple[int, int]]:
    """Log-normal prompt and output lengths with medians input_len / output_len (a ShareGPT-like
    long tail), clipped to [4, 8x median] and [1, 8x median] and to the context length."""
    ins = np.clip(np.round(input_len * rng.lognormal(0.0, sigma, num)), 4, 8 * input_len)
    outs = np.clip(np.round(output_len * rng.lognormal(0.0, sigma, num)), 1, 8 * output_len)
    outs = np.minimum(outs, max_model_len - 4)
    ins = np.minimum(ins, max_model_len - outs)
    return [(int(i), int(o)) for i, o in zip(ins, outs)]


def synthetic_chat_dataset(num: int, input_len: int, output_len: int, seed: int,
                           tokenizer=None, max_model_len: int = 2048) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    pool = plain_token_ids(tokenizer) if tokenizer is not None else None
    out = []
    for n_in, n_out in chat_lengths(num, input_len, output_len, rng, max_model_len):
        text, n = make_prompt(n_in, rng, tokenizer, pool, "words")
        out.append(SampleRequest(text, n, n_out))
    return out


# -- arrivals ----------------------------------------------------------------------------------

def arrival_gaps(num: int, rate: float, burstiness: float, rng) -> np.ndarray:
    """Gaps between arrivals: Gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate.
    burstiness 1 is a Poisson process; < 1 burstier, > 1 more even. rate inf: all at t=0."""
    if math.isinf(rate):
        return np.zeros(num)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (s from start). As vLLM does, rescaled so the last one is at num/rate."""
    times = np.cumsum(arrival_gaps(num, rate, burstiness, np.random.default_rng(seed)))
    if num and times[-1] > 0:
        times *= (num / rate) / times[-1]
    return times
