"""Gemma 2 and Gemma 3 (text) against transformers: logits over the paged cache and greedy
tokens through the engine, with prompts and decodes well past the sliding windows, across
page boundaries, chunked prefill and the default buckets; the config fields each family reads
and those we refuse."""
import json

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.config import ConfigError, ModelConfig
from serving import LLM, SamplingParams
from tests.hf_tiny import GEMMA_FAMILIES, greedy_reference, tiny_hf_model
from tests.test_model_parity import paged_logits

PAGE = 4
RTOL = 1e-4  # of max |transformers logit|, float32
# Past the windows (8 and 6 tokens): 23 and 40 prompt tokens, 12 decoded.
PROMPTS = [[5], list(range(10, 17)), [(7 * i) % 200 + 3 for i in range(23)],
           [(13 * i) % 205 + 3 for i in range(40)]]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# max_num_batched_tokens 16: the 23- and 40-token prompts prefill in chunks.
DEFAULTS = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16, page_size=PAGE,
                progress=False)


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, tiny_hf_model(request.param, folder), folder


def test_config_reads_each_family(family):
    name, model, folder = family
    cfg = ModelConfig.from_dir(folder)
    assert cfg.norm_offset and cfg.sandwich_norms and cfg.scale_embed
    assert cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.attn_scale == pytest.approx(24 ** -0.5)
    if name == "gemma2":
        assert cfg.sliding_windows == (8, 0, 8, 0)
        assert (cfg.attn_soft_cap, cfg.final_soft_cap) == (2.0, 3.0)
        assert not cfg.qk_norm and not cfg.local_rope_theta
    else:
        assert cfg.sliding_windows == (6,) * 5 + (0, 6)
        assert (cfg.attn_soft_cap, cfg.final_soft_cap) == (0.0, 0.0)
        assert cfg.qk_norm and cfg.local_rope_theta == 100.0
        assert cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.jax_cache
def test_logits_match_transformers(family):
    name, model, folder = family
    cfg, params = load_model(folder, progress=False)
    prompts = PROMPTS[1:]
    logits, off = paged_logits(params, cfg, prompts, PAGE), 0
    for p in prompts:
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0].numpy()
        err = np.abs(logits[off:off + len(p)] - want).max() / np.abs(want).max()
        assert err < RTOL, (name, len(p), err)
        off += len(p)


def test_greedy_tokens_match_transformers(family):
    """Batched, chunked prefill, the default buckets; the first window layer's keys fall
    out of its window from the 9th (7th) token on."""
    name, model, folder = family
    llm = LLM(str(folder), **DEFAULTS)
    ours = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert ours == [greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.jax_cache
def test_the_window_changes_the_answer(family):
    """The window is read: the same weights with windows wider than the prompt (the window
    layers' own RoPE kept) give other logits past the window, so the parity above cannot
    come from full attention."""
    name, model, folder = family
    cfg, params = load_model(folder, progress=False)
    wide = tuple(1000 if w else 0 for w in cfg.sliding_windows)
    full = cfg.__class__(**{**cfg.to_dict(), "sliding_windows": wide})
    windowed, unwindowed = (paged_logits(params, c, [PROMPTS[3]], PAGE) for c in (cfg, full))
    window = min(w for w in cfg.sliding_windows if w)
    np.testing.assert_array_equal(windowed[:window], unwindowed[:window])
    assert np.abs(windowed[window:] - unwindowed[window:]).max() > 1e-3


def _hf_config(folder, **fields):
    hf = json.loads((folder / "config.json").read_text())
    hf.update(fields)
    return hf


def test_old_config_files_are_read(family, tmp_path):
    """Hub configs written before transformers 5: no layer_types (a pattern instead) and,
    for Gemma 3, rope_theta / rope_local_base_freq / rope_scaling."""
    name, _, folder = family
    hf = _hf_config(folder)
    del hf["layer_types"]
    if name == "gemma3":
        del hf["rope_parameters"]
        hf.update(rope_theta=10000.0, rope_local_base_freq=100.0, sliding_window_pattern=6,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    new, old = ModelConfig.from_dir(folder), ModelConfig.from_hf(hf)
    # Gemma 3's 7th layer is a window layer by its pattern of 6, as in the saved layer_types
    assert old == new


@pytest.mark.parametrize("fields, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "activation"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
])
def test_unsupported_fields_are_refused(tmp_path, fields, message):
    tiny_hf_model("gemma2", tmp_path)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_hf_config(tmp_path, **fields))
