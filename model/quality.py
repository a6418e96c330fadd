"""Does a quantized model still know what it knew? Perplexity on a fixed text and greedy
agreement with the unquantized model, both run through the serving forward
(`model.transformer.forward` over the paged KV cache), so the KV-cache dtypes are measured
on the very path the engine uses.

- perplexity: the text is cut into windows of `window` tokens, each a request of its own;
  all windows advance together, `chunk` tokens per step (chunked prefill, teacher forced).
- greedy: each prompt is prefilled, then decoded `max_new_tokens` tokens greedily, one token
  per request per step. `greedy_match` compares those tokens position by position with the
  reference model's; `tf_agree` feeds the reference tokens to the model and counts how often
  its argmax is the reference's next token (no drift after a first difference).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model.attention import resolve_backend
from model.batch import Batch, sequences_batch
from model.checkpoint import param_bytes
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.runtime_params import prepare_params
from model.transformer import forward

PAGE_SIZE = 16


def _score(params, cache, batch, targets, cfg: ModelConfig):
    """-> (log p(target) f32[T], argmax int32[T], cache): logits never leave the device.
    params: prepared (see prepare_params), as every public function here makes them. The
    attention backend is the one the engine picks for this device (model/attention.py
    resolve_backend's "auto")."""
    return _score_on(params, cache, batch, targets, cfg, resolve_backend("auto"))


@partial(jax.jit, static_argnames=("cfg", "backend"))
def _score_on(params, cache, batch, targets, cfg: ModelConfig, backend: str):
    logits, cache = forward(params, cache, batch, cfg, backend)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return picked, jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def _pages(num_seqs: int, length: int):
    """Page table giving each sequence its own pages (page 0 stays the unused sink)."""
    per = -(-length // PAGE_SIZE)
    return 1 + np.arange(num_seqs * per, dtype=np.int32).reshape(num_seqs, per), 1 + num_seqs * per


def _zeros(cfg: ModelConfig, num_pages: int, kv_cache_dtype) -> KVCache:
    """A cache committed to the device like the caches _score returns, so that the first
    call and the later ones share one compiled program."""
    return jax.device_put(KVCache.zeros(cfg, num_pages, PAGE_SIZE, kv_cache_dtype),
                          jax.devices()[0])


def perplexity(cfg: ModelConfig, params, tokens: list[int], *, kv_cache_dtype=None,
               window: int = 512, chunk: int = 128) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window.

    Every step is padded to len(windows) * chunk tokens (padding writes to the sink page and
    is not scored), so one program serves the whole text."""
    params = prepare_params(params)
    windows = [tokens[i:i + window] for i in range(0, len(tokens), window)]
    windows = [w for w in windows if len(w) > 1]
    table, num_pages = _pages(len(windows), window)
    sink = np.zeros_like(table[0])
    cache = _zeros(cfg, num_pages, kv_cache_dtype)
    nll, count = 0.0, 0
    for start in range(0, max(map(len, windows)), chunk):
        seqs, targets, valid = [], [], []  # seqs: (tokens, page-table row, first position)
        for w, row in zip(windows, table):
            piece, nxt = w[start:start + chunk], w[start + 1:start + 1 + chunk]
            if piece:
                seqs.append((piece, row, start))
                targets += nxt + [0] * (len(piece) - len(nxt))
                valid += [True] * len(nxt) + [False] * (len(piece) - len(nxt))
        while len(valid) < len(windows) * chunk:
            n = min(chunk, len(windows) * chunk - len(valid))
            seqs.append(([0] * n, sink, 0))
            targets += [0] * n
            valid += [False] * n
        pieces, rows, starts = zip(*seqs)
        rows = rows + (sink,) * (2 * len(windows) - len(rows))  # a fixed page-table shape
        batch = sequences_batch(list(pieces), np.stack(rows), PAGE_SIZE, start=list(starts))
        logp, _, cache = _score(params, cache, batch, np.asarray(targets, np.int32), cfg)
        logp = np.asarray(logp)[np.asarray(valid)]
        nll -= float(logp.sum())
        count += logp.size
    return math.exp(nll / count)


def greedy(cfg: ModelConfig, params, prompts: list[list[int]], max_new_tokens: int, *,
           kv_cache_dtype=None) -> list[list[int]]:
    """Greedy continuations of every prompt, decoded together one token per step."""
    params = prepare_params(params)
    n = len(prompts)
    table, num_pages = _pages(n, max(map(len, prompts)) + max_new_tokens)
    cache = _zeros(cfg, num_pages, kv_cache_dtype)
    batch = sequences_batch(prompts, table, PAGE_SIZE)
    last = np.cumsum([len(p) for p in prompts]) - 1
    batch.logits_indices = last.astype(np.int32)
    _, next_ids, cache = _score(params, cache, batch, np.zeros(n, np.int32), cfg)
    out = [[int(t)] for t in np.asarray(next_ids)]
    for step in range(1, max_new_tokens):
        pos = np.asarray([len(p) + step - 1 for p in prompts], np.int32)
        slots = table[np.arange(n), pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        ids = np.asarray([o[-1] for o in out], np.int32)
        rows = np.arange(n, dtype=np.int32)
        batch = Batch(ids, pos, slots.astype(np.int32), rows, table, rows)
        _, next_ids, cache = _score(params, cache, batch, np.zeros(n, np.int32), cfg)
        for o, t in zip(out, np.asarray(next_ids)):
            o.append(int(t))
    return out


def teacher_forced_agreement(cfg: ModelConfig, params, prompts: list[list[int]],
                             continuations: list[list[int]], *, kv_cache_dtype=None) -> float:
    """Fraction of continuation tokens that are the model's argmax given the true prefix."""
    params = prepare_params(params)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    table, num_pages = _pages(len(seqs), max(map(len, seqs)))
    cache = _zeros(cfg, num_pages, kv_cache_dtype)
    batch = sequences_batch(seqs, table, PAGE_SIZE)
    _, argmax, _ = _score(params, cache, batch, np.zeros(len(batch.input_ids), np.int32), cfg)
    argmax, hits, total, offset = np.asarray(argmax), 0, 0, 0
    for p, c in zip(prompts, continuations):
        predicted = argmax[offset + len(p) - 1:offset + len(p) + len(c) - 1]
        hits += int((predicted == np.asarray(c)).sum())
        total += len(c)
        offset += len(p) + len(c)
    return hits / total


def match_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return sum(x == y for x, y in pairs) / len(pairs)


@dataclass
class QualityRow:
    weights: str  # "none" or a recipe spec
    kv_cache_dtype: str
    weight_bytes: int
    perplexity: float
    greedy_match: float
    tf_agree: float
    ppl_change: float | None = None  # relative to the first row (the unquantized model)


def evaluate(cfg: ModelConfig, params, tokens: list[int], prompts: list[list[int]],
             configs: list[tuple[str, str]], *, max_new_tokens: int = 32, window: int = 512,
             log=print) -> list[QualityRow]:
    """One row per (weights, kv_cache_dtype) config; greedy references come from the
    unquantized weights with the model-dtype cache."""
    from quant.recipe import quantize_params
    reference = greedy(cfg, params, prompts, max_new_tokens)
    rows = []
    for weights, kv in configs:
        p = prepare_params(params if weights == "none" else quantize_params(params, weights))
        kv_dtype = None if kv == "auto" else kv
        row = QualityRow(
            weights, kv, param_bytes(p),
            perplexity(cfg, p, tokens, kv_cache_dtype=kv_dtype, window=window),
            match_fraction(greedy(cfg, p, prompts, max_new_tokens, kv_cache_dtype=kv_dtype),
                           reference),
            teacher_forced_agreement(cfg, p, prompts, reference, kv_cache_dtype=kv_dtype))
        row.ppl_change = row.perplexity / rows[0].perplexity - 1 if rows else 0.0
        log(format_table([row], header=not rows))
        rows.append(row)
    return rows


def format_table(rows: list[QualityRow], header: bool = True) -> str:
    lines = [f"{'weights':<12} {'kv cache':<8} {'weights MiB':>11} {'perplexity':>10} "
             f"{'change':>7} {'greedy match':>12} {'tf agree':>8}"] if header else []
    for r in rows:
        change = "" if r.ppl_change is None else f"{100 * r.ppl_change:+.2f}%"
        lines.append(f"{r.weights:<12} {r.kv_cache_dtype:<8} {r.weight_bytes / 2**20:>11.1f} "
                     f"{r.perplexity:>10.4f} {change:>7} {r.greedy_match:>12.3f} "
                     f"{r.tf_agree:>8.3f}")
    return "\n".join(lines)
