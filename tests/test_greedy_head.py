"""The fused greedy head (model/greedy_head.py): where it applies, the tokens of the logits'
argmax for any batch; where it does not (soft-capped logits, 16-bit activations, a sharded
vocabulary), None; and the engine's step programs use it, greedy answers unchanged."""
from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import tiny_hf_model
from model.checkpoint import load_model
from model.greedy_head import greedy_tokens
from model.runtime_params import prepare_params
from model.transformer import compute_logits


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # its own head / a tied table
def model(request, tmp_path_factory, demo_model_dir):
    """(folder, config, prepared params) of a tiny model with the demo's tokenizer."""
    folder = tmp_path_factory.mktemp(request.param)
    tiny_hf_model(request.param, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model_dir / name, folder / name)
    cfg, params = load_model(folder, progress=False)
    return folder, cfg, prepare_params(params)


@pytest.mark.jax_cache
def test_the_tokens_of_the_logits_argmax_whatever_the_batch(model):
    _, cfg, params = model
    vocab = cfg.vocab_size - 5  # a tokenizer short of the embedding's rows
    fused = greedy_tokens(params, cfg, vocab)
    assert fused is not None
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((64, cfg.hidden_size)),
                         jnp.float32)
    want = np.asarray(jnp.argmax(compute_logits(params, hidden, cfg)[:, :vocab], axis=-1))
    run = jax.jit(fused)
    np.testing.assert_array_equal(np.asarray(run(hidden)), want)
    for n in (1, 6, 13):
        np.testing.assert_array_equal(np.asarray(run(hidden[-n:])), want[-n:])


@pytest.mark.jax_cache
def test_heads_it_cannot_fuse_get_none(model):
    _, cfg, params = model
    from dataclasses import replace
    assert greedy_tokens(params, replace(cfg, final_soft_cap=30.0), cfg.vocab_size) is None
    assert greedy_tokens(params, cfg.with_dtype("bfloat16"), cfg.vocab_size) is None
    assert greedy_tokens(params, cfg, cfg.vocab_size, axis="model") is None
    unpacked = prepare_params(load_model(model[0], progress=False)[1], pack=False)
    assert greedy_tokens(unpacked, cfg, cfg.vocab_size) is None


def test_the_engine_steps_through_it_with_the_same_greedy_answers(model, monkeypatch):
    """The engine's step program calls the fused kernel; with the fusion off (the logits and
    their argmax), every request's greedy tokens are the same."""
    folder, _, _ = model
    from serving.core.sampling_params import SamplingParams
    from serving.engine import runner
    from serving.engine.llm import LLM
    prompts = [[1, 5, 9, 14], [1, 7], [1, 3, 3, 8, 20, 2, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate():
        llm = LLM(str(folder), max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, token_buckets=(4, 16),
                  request_buckets=(4,), compilation_cache_dir="", progress=False)
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs]

    seen = []
    real = runner.greedy_tokens
    monkeypatch.setattr(runner, "greedy_tokens",
                        lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    fused = generate()
    assert seen and all(f is not None for f in seen)
    monkeypatch.setattr(runner, "greedy_tokens", lambda *a, **k: None)
    unfused = generate()
    assert fused == unfused
