"""Speculative decoding (n-gram proposals, verified in the step): the same tokens as without
it for greedy and seeded requests, penalties, bias, logprobs, stop strings and n > 1 on a
tiny random model and the demo model; rejection sampling keeps the target distribution
(chi-square, and a wrong acceptance rule shown to fail the same test); pages come back;
nothing compiles after warm-up. docs/architecture.md, "Speculative decoding"."""
from __future__ import annotations

import dataclasses
import random
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

from serving import LLM, SamplingParams
from serving.core.ngram_proposer import propose_ngram
from serving.core.spec_config import SpeculativeConfig
from serving.engine.rejection_sampler import emitted_rows
from serving.engine.sampler import sample
from serving.engine.step_buffers import unpack
from tests.demo_engine import greedy
from tests.test_engine import TINY_OPTIONS, tiny_model, torch_one_thread  # noqa: F401
from tests.test_sampler import inputs

SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
            prompt_lookup_min=1, disable_by_batch_size=16)


@pytest.fixture(scope="module")
def tiny_off(tiny_model):  # noqa: F811
    return LLM(str(tiny_model[1]), **TINY_OPTIONS)


@pytest.fixture(scope="module")
def tiny_on(tiny_model):  # noqa: F811
    return LLM(str(tiny_model[1]), speculative_config=SPEC, **TINY_OPTIONS)


def repetitive_prompts(rng, n, vocab=211):
    """Prompts that repeat a phrase (input-grounded: lookups hit) and plain random ones."""
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        if i % 3 == 2:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(4, 20))])
        else:
            prompts.append(phrase * rng.randint(2, 3) + phrase[:rng.randint(0, 2)])
    return prompts


def run(llm: LLM, prompts, params):
    return llm.generate(prompts, params)


# -- host: proposer and config ---------------------------------------------------------------

def reference_ngram(tokens, k, min_n, max_n):
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for i in range(L - n - 1, -1, -1):  # the newest earlier occurrence first
            if tokens[i:i + n] == tokens[L - n:]:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_proposer_matches_a_brute_force_lookup():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        got = propose_ngram(np.asarray(tokens), k, lo, hi)
        assert got == reference_ngram(tokens, k, lo, hi), (tokens, k, lo, hi)


@pytest.mark.parametrize("bad, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}', "exceeds"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "x"}', "does not exist"),
    ('"ngram"', "JSON object"),
])
def test_bad_speculative_configs_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_cli_refuses_a_bad_speculative_config(capsys):
    from serving.cli import main
    assert main(["serve", "--speculative-config", '{"method": "ngram"}']) == 1
    assert "num_speculative_tokens" in capsys.readouterr().err


# -- device: the acceptance rule -------------------------------------------------------------

def test_emitted_rows_stop_at_the_first_rejection():
    tokens = jnp.array([5, 6, 9, 1, 4, 4, 7, 0], jnp.int32)
    drafts = jnp.array([5, 6, 7, -1, 4, -1, 8, -1], jnp.int32)  # rows: 0-3, 4-5, 6-7
    starts = jnp.array([0, 0, 0, 0, 4, 4, 6, 6], jnp.int32)
    np.testing.assert_array_equal(emitted_rows(tokens, drafts, starts),
                                  [1, 1, 1, 0, 1, 1, 1, 0])


# A bigram "model": the next token's logits depend on the last token only, so the logits of
# every verified position are known without a network.
V, START, DRAFT = 8, 0, (3, 5)
_sample = jax.jit(partial(sample, num_top=2))
TABLE = np.random.default_rng(3).normal(0, 1.2, (V, V)).astype(np.float32)
TABLE[START, 3] += 1.5  # the first proposed token is likely, so the rule matters


def chain_without_speculation(seeds):
    """Two tokens per seed, one position at a time, as a plain decode would draw them."""
    n = len(seeds)
    s0 = inputs(n, temperature=1.0, seed=seeds, output_index=0)
    first = np.asarray(_sample(jnp.asarray(TABLE[[START] * n]), s0).tokens)
    s1 = inputs(n, temperature=1.0, seed=seeds, output_index=1)
    second = np.asarray(_sample(jnp.asarray(TABLE[first]), s1).tokens)
    return first, second


def verify_rows(seeds):
    """Each seed a request verifying DRAFT: rows after START, START d1, START d1 d2."""
    n, k = len(seeds), len(DRAFT)
    context = [START, *DRAFT]
    logits = np.concatenate([TABLE[[context[j]] * n] for j in range(k + 1)])
    order = np.arange(n * (k + 1)).reshape(k + 1, n).T.reshape(-1)  # request-major rows
    logits = logits[order]
    s = inputs(n * (k + 1), temperature=1.0, seed=np.repeat(seeds, k + 1),
               output_index=np.tile(np.arange(k + 1), n))
    tokens = np.asarray(_sample(jnp.asarray(logits), s).tokens)
    drafts = np.tile(np.array([*DRAFT, -1], np.int32), n)
    starts = np.repeat(np.arange(n) * (k + 1), k + 1).astype(np.int32)
    return tokens.reshape(n, k + 1), drafts, starts, s, logits


def chain_with_speculation(seeds):
    tokens, drafts, starts, _, _ = verify_rows(seeds)
    emitted = np.asarray(emitted_rows(jnp.asarray(tokens.reshape(-1)), jnp.asarray(drafts),
                                      jnp.asarray(starts))).reshape(tokens.shape)
    first = tokens[:, 0]
    # The second token: the verified row when the first was accepted; otherwise the next
    # step draws it after the target's first token (a plain decode of one position).
    second = np.where(emitted[:, 1], tokens[:, 1], -1)
    redo = second < 0
    if redo.any():
        s1 = inputs(int(redo.sum()), temperature=1.0, seed=np.asarray(seeds)[redo],
                    output_index=1)
        second[redo] = np.asarray(_sample(jnp.asarray(TABLE[first[redo]]), s1).tokens)
    return first, second


def chain_with_a_wrong_rule(seeds):
    """After a rejection, draws again from p itself instead of the residual (p without the
    proposed token): the proposed token gets a second chance."""
    tokens, _, _, _, _ = verify_rows(seeds)
    first = tokens[:, 0]
    redraw = np.asarray(_sample(jnp.asarray(TABLE[[START] * len(seeds)]),
                                        inputs(len(seeds), temperature=1.0,
                                               seed=np.asarray(seeds) + 10**6)).tokens)
    first = np.where(first == DRAFT[0], first, redraw)
    s1 = inputs(len(seeds), temperature=1.0, seed=seeds, output_index=1)
    second = np.asarray(_sample(jnp.asarray(TABLE[first]), s1).tokens)
    return first, second


def two_sample_p(a, b) -> float:
    """Chi-square test of homogeneity of two samples of categories (rare cells pooled)."""
    cats = sorted(set(a) | set(b))
    table = np.array([[np.sum(np.asarray(x) == c) for c in cats] for x in (a, b)])
    big = table.sum(0) >= 10
    table = np.column_stack([table[:, big], table[:, ~big].sum(1)]) if (~big).any() \
        else table
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


N_SEEDS = 4000


def test_rejection_sampling_keeps_the_distribution_and_a_wrong_rule_fails():
    off = chain_without_speculation(np.arange(N_SEEDS))
    on = chain_with_speculation(np.arange(N_SEEDS, 2 * N_SEEDS))
    wrong = chain_with_a_wrong_rule(np.arange(N_SEEDS, 2 * N_SEEDS))
    pairs = lambda c: list(zip(*c))  # noqa: E731
    for i in (0, 1):
        assert two_sample_p(off[i], on[i]) > 1e-3
    assert two_sample_p(pairs(off), pairs(on)) > 1e-3
    assert two_sample_p(off[0], wrong[0]) < 1e-6
    assert two_sample_p(pairs(off), pairs(wrong)) < 1e-6
    # The verified rows are the plain draws, seed for seed (same noise, same context).
    same = chain_without_speculation(np.arange(N_SEEDS, 2 * N_SEEDS))
    np.testing.assert_array_equal(on[0], same[0])
    np.testing.assert_array_equal(on[1], same[1])


# -- the engine -------------------------------------------------------------------------------

def check_same(off, on):
    for a, b in zip(off, on):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert (x.text, x.finish_reason) == (y.text, y.finish_reason)
            if x.logprobs is not None:
                assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
                for p, q in zip(x.logprobs, y.logprobs):
                    assert (p.token_id, p.top) == (q.token_id, q.top)
                    assert p.logprob == q.logprob


def accepted(llm: LLM):
    s = llm.engine.scheduler.spec_stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def test_greedy_is_the_same_with_speculation_tiny(tiny_off, tiny_on):
    prompts = repetitive_prompts(random.Random(1), 12)
    before = accepted(tiny_on)
    check_same(run(tiny_off, prompts, greedy(24)), run(tiny_on, prompts, greedy(24)))
    drafts, proposed, kept = (a - b for a, b in zip(accepted(tiny_on), before))
    assert drafts > 10 and 0 < kept < proposed  # accepted and rejected tokens both ran
    alloc = tiny_on.engine.scheduler.allocator
    assert alloc.num_used_pages == 0 and alloc.num_free_pages == alloc.num_usable_pages


def test_sampling_knobs_give_the_same_tokens_with_speculation(tiny_off, tiny_on):
    rng = random.Random(2)
    prompts = repetitive_prompts(rng, 9)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=8, max_tokens=20,
                       logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, logit_bias={5: 3.0, 9: -50.0}, max_tokens=20,
                       logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, n=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=20),
        SamplingParams(temperature=0.9, seed=10, max_tokens=20, stop_token_ids=[17, 33]),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=11, frequency_penalty=0.4, max_tokens=20,
                       ignore_eos=True),
    ]
    before = accepted(tiny_on)
    off, on = run(tiny_off, prompts, params), run(tiny_on, prompts, params)
    check_same(off, on)
    assert accepted(tiny_on)[2] > before[2]


def test_stop_strings_end_at_the_same_token(tiny_off, tiny_on):
    prompts = repetitive_prompts(random.Random(3), 6)[:4]
    free = run(tiny_off, prompts, greedy(24))
    params = []
    for r in free:  # a stop string from the middle of each output's text
        text = r.text
        params.append(greedy(24, stop=[text[len(text) // 2:len(text) // 2 + 2]])
                      if len(text) > 6 else greedy(24))
    off, on = run(tiny_off, prompts, params), run(tiny_on, prompts, params)
    check_same(off, on)
    assert any(r.finish_reason == "stop" and len(r.token_ids) < 24 for r in on)


def test_nothing_compiles_after_warm_up_with_speculation(tiny_on):
    compiled = tiny_on.engine.runner.num_compiled
    run(tiny_on, repetitive_prompts(random.Random(4), 20), greedy(12))
    assert tiny_on.engine.runner.num_compiled == compiled
    assert len(tiny_on.engine.step_shapes) == compiled


def test_speculation_is_off_above_the_batch_size(tiny_model):  # noqa: F811
    llm = LLM(str(tiny_model[1]), speculative_config={**SPEC, "disable_by_batch_size": 2},
              **TINY_OPTIONS)
    rng = random.Random(5)
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append((len(llm.engine.scheduler.running),
                      sum(len(s.spec_token_ids) for s in out.scheduled)))
        return out

    llm.engine.scheduler.schedule = recording
    run(llm, repetitive_prompts(rng, 6), [greedy(4 + 6 * i) for i in range(6)])  # drains
    assert any(k for _, k in steps)
    assert all(k == 0 for running, k in steps if running > 2)


def frequency_prompt(tiny_off: LLM) -> list[int]:
    """Each likely first token t appears at the start of the prompt followed by the argmax
    after t, so the lookup proposes a likely token. The tiny model's sliding window keeps
    the prompt's start out of the last token's view."""
    rng = random.Random(6)
    base = [rng.randrange(100, 211) for _ in range(30)]
    top = run(tiny_off, [base], greedy(1, logprobs=4))[0].logprobs[0].top
    firsts = [t for t, _ in top]
    follow = [r.token_ids[0] for r in run(tiny_off, [base + [t] for t in firsts], greedy(1))]
    return [x for pair in zip(firsts, follow) for x in pair] + base


N_DRAWS = 600


def draws(llm: LLM, prompt: list[int], seeds) -> list[list[int]]:
    params = [SamplingParams(temperature=1.0, top_k=4, seed=s, max_tokens=3, ignore_eos=True)
              for s in seeds]
    return [r.token_ids for r in run(llm, [prompt] * len(params), params)]


def test_sampled_token_frequencies_match_without_speculation(tiny_off, tiny_on):
    """Three tokens per seed at temperature 1 (top-k 4), many seeds, speculation on vs off on
    different seeds: the second and third tokens (the verified row and the one after it)
    have the same frequencies (chi-square)."""
    prompt, n = frequency_prompt(tiny_off), N_DRAWS
    before = accepted(tiny_on)
    off, on = draws(tiny_off, prompt, range(n)), draws(tiny_on, prompt, range(n, 2 * n))
    drafts, _, kept = (a - b for a, b in zip(accepted(tiny_on), before))
    assert drafts >= n // 2 and kept >= n // 10, (drafts, kept)
    for i in (1, 2):
        assert two_sample_p([t[i] for t in off], [t[i] for t in on]) > 1e-3
    assert two_sample_p([tuple(t[1:]) for t in off], [tuple(t[1:]) for t in on]) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_engine_frequency_test(tiny_model, tiny_off,  # noqa: F811
                                                                  monkeypatch):
    """The test above, with an engine whose step takes a rejected guess anyway when the
    target's draw has an odd id (the guess is then accepted more often than p(d)): the
    second token's frequencies differ."""
    import serving.engine.runner as runner

    right = runner._step

    def wrong_step(params, cache, buffers, history, bitmask, last_tokens, *, layout, **kwargs):
        sampled, _, blocks, cache, next_tokens = right(params, cache, buffers, history, bitmask,
                                                       last_tokens, layout=layout, **kwargs)
        batch, _ = unpack(buffers, layout)
        drafts, tokens = batch["draft_ids"], sampled.tokens
        tokens = jnp.where((drafts >= 0) & (tokens != drafts) & (tokens % 2 == 1), drafts,
                           tokens)
        return (dataclasses.replace(sampled, tokens=tokens),
                emitted_rows(tokens, drafts, batch["row_start"]), blocks, cache, next_tokens)

    monkeypatch.setattr(runner, "_step", wrong_step)
    wrong = LLM(str(tiny_model[1]), speculative_config=SPEC, compilation_cache_dir=None,
                **TINY_OPTIONS)
    prompt, n = frequency_prompt(tiny_off), N_DRAWS
    off, bad = draws(tiny_off, prompt, range(n)), draws(wrong, prompt, range(n, 2 * n))
    assert accepted(wrong)[2] >= n // 10
    assert two_sample_p([t[1] for t in off], [t[1] for t in bad]) < 1e-6


# -- the demo model ----------------------------------------------------------------------------

DEMO_PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. Repeat: the "
    "quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Hello",
    "Copy the list: apples, pears, plums, figs. The list: apples,",
]


def test_greedy_is_the_same_with_speculation_demo(demo_checkpoint, demo_llm):
    from tests.demo_engine import DEMO_OPTIONS
    off = demo_llm
    on = LLM(str(demo_checkpoint), speculative_config={**SPEC, "num_speculative_tokens": 4},
             **DEMO_OPTIONS)
    prompts = [off.tokenizer.encode(p) for p in DEMO_PROMPTS]
    check_same(run(off, prompts, greedy(32)), run(on, prompts, greedy(32)))
    drafts, proposed, kept = accepted(on)
    assert drafts > 0 and kept > 0
