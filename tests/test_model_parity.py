"""Each family, converted with scripts/convert_hf.py, matches transformers in float32."""
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.batch import sequences_batch
from model.checkpoint import load_model
from model.kv_cache import KVCache
from model.transformer import forward
from tests.hf_tiny import FAMILIES, tiny_hf_model

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4
# Measured max |ours - transformers| / max |transformers| is about 5e-7 in float32.
RTOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 4], [100, 101, 102, 103, 104, 105, 106, 107],
           [17]]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp(request.param)
    model = tiny_hf_model(request.param, hf_dir)
    out = hf_dir.parent / (hf_dir.name + "_ckpt")
    r = subprocess.run([sys.executable, "scripts/convert_hf.py", str(hf_dir), str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cfg, params = load_model(out)
    return request.param, model, cfg, params


def hf_logits(model, tokens):
    import torch
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def scattered_page_table(num_seqs, pages_per_seq, seed=0):
    """Pages 1..N in a random order, so sequences do not sit on consecutive pages."""
    pages = np.random.default_rng(seed).permutation(np.arange(1, 1 + num_seqs * pages_per_seq))
    return pages.reshape(num_seqs, pages_per_seq).astype(np.int32)


_forward = jax.jit(forward, static_argnums=3)


def run(params, cfg, cache, batch):
    return _forward(params, cache, jax.tree.map(jnp.asarray, batch), cfg)


def paged_logits(params, cfg, prompts, page_size, pages_per_seq=16):
    """Every prompt token's logits [sum of lengths, V], the prompts prefilled in one step
    over scattered pages."""
    table = scattered_page_table(len(prompts), pages_per_seq)
    cache = KVCache.zeros(cfg, 1 + table.size, page_size)
    return np.asarray(run(params, cfg, cache, sequences_batch(prompts, table, page_size))[0])


def assert_close(got, want):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < RTOL, err


def test_prefill_batch_matches_transformers(family):
    name, model, cfg, params = family
    table = scattered_page_table(len(PROMPTS), 4)
    cache = KVCache.zeros(cfg, 1 + table.size, PAGE)
    logits, _ = run(params, cfg, cache, sequences_batch(PROMPTS, table, PAGE))
    logits, off = np.asarray(logits), 0
    for p in PROMPTS:
        assert_close(logits[off:off + len(p)], hf_logits(model, p))
        off += len(p)


def test_prefill_then_decode_matches_full_forward(family):
    """Prefill a prefix of each sequence, then decode the rest one token per step (all
    sequences batched together), and compare with one forward over the whole sequence."""
    name, model, cfg, params = family
    seqs = [list(range(20, 33)), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], list(range(150, 162))]
    prefix = [5, 2, 4]
    table = scattered_page_table(len(seqs), 4, seed=1)
    cache = KVCache.zeros(cfg, 1 + table.size, PAGE)
    _, cache = run(params, cfg, cache, sequences_batch([s[:n] for s, n in zip(seqs, prefix)],
                                                       table, PAGE))
    got = {i: [] for i in range(len(seqs))}
    for step in range(8):  # every sequence decodes 8 tokens: one compiled decode shape
        batch = sequences_batch([[s[n + step]] for s, n in zip(seqs, prefix)], table, PAGE,
                                start=[n + step for n in prefix])
        logits, cache = run(params, cfg, cache, batch)
        for i in got:
            got[i].append(np.asarray(logits[i]))
    for i, (s, n) in enumerate(zip(seqs, prefix)):
        assert_close(np.stack(got[i]), hf_logits(model, s)[n:])


def test_bfloat16_close_to_float32(family, tmp_path):
    name, model, cfg, params = family
    table = scattered_page_table(1, 4)
    batch = sequences_batch([PROMPTS[0]], table, PAGE)
    f32, _ = run(params, cfg, KVCache.zeros(cfg, 1 + table.size, PAGE), batch)
    cfg16 = cfg.with_dtype("bfloat16")
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    b16, _ = run(p16, cfg16, KVCache.zeros(cfg16, 1 + table.size, PAGE), batch)
    assert b16.dtype == jnp.float32
    # bfloat16 keeps 8 bits of mantissa; the argmax agrees and the error stays small.
    assert np.abs(np.asarray(b16) - np.asarray(f32)).max() < 0.05 * np.abs(f32).max()
