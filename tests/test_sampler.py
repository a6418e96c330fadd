"""serving.engine.sampler.sample on hand-made logits: each knob against its definition or a numpy
reference. One jitted `sample` per shape; rows carry the per-request settings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine.sampler import (NUM_TOP_LOGPROBS, SamplingInputs, apply_bias, apply_filters,
                             apply_penalties, sample)

V = 32
R = 8  # every test pads to R rows (or BIG) so only two programs compile per function
BIG = 2000
_sample = jax.jit(sample)
_filters, _penalties, _bias = (jax.jit(f) for f in (apply_filters, apply_penalties, apply_bias))


def inputs(R, *, history=None, bias=None, **rows) -> SamplingInputs:
    """Per-row settings (scalars broadcast); the any_* flags follow the rows as prepare() sets them."""
    def col(name, default, dtype):
        return np.broadcast_to(np.asarray(rows.get(name, default), dtype), (R,)).copy()

    s = dict(temperature=col("temperature", 0.0, np.float32), top_k=col("top_k", 0, np.int32),
             top_p=col("top_p", 1.0, np.float32), min_p=col("min_p", 0.0, np.float32),
             seed=col("seed", 0, np.uint32), output_index=col("output_index", 0, np.int32),
             repetition_penalty=col("repetition_penalty", 1.0, np.float32),
             presence_penalty=col("presence_penalty", 0.0, np.float32),
             frequency_penalty=col("frequency_penalty", 0.0, np.float32),
             num_prompt=col("num_prompt", 0, np.int32))
    s["history"] = np.full((R, 8), -1, np.int32)
    if history is not None:
        history = np.asarray(history, np.int32)
        s["history"][:len(history), :history.shape[1]] = history
    s["bias_ids"], s["bias_values"] = np.full((R, 3), -1, np.int32), np.zeros((R, 3), np.float32)
    if bias is not None:
        ids, values = (np.asarray(b) for b in bias)
        s["bias_ids"][:len(ids), :ids.shape[1]] = ids
        s["bias_values"][:len(ids), :ids.shape[1]] = values
    s["any_penalty"] = np.bool_(history is not None)
    s["any_bias"] = np.bool_(bias is not None)
    random = s["temperature"] > 0
    s["any_filter"] = np.bool_(np.any(random & ((s["top_k"] > 0) | (s["top_p"] < 1) | (s["min_p"] > 0))))
    s["any_random"] = np.bool_(random.any())
    s["any_logprobs"] = np.bool_(rows.get("logprobs", False))
    return SamplingInputs(**s)


def run(logits, s):
    return jax.tree.map(np.asarray, _sample(jnp.asarray(logits, jnp.float32), s))


def kept(logits, s):
    """Which tokens apply_filters leaves finite."""
    return np.isfinite(np.asarray(_filters(jnp.asarray(logits, jnp.float32), s)))


def random_logits(rows, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(0, scale, (rows, V)).astype(np.float32)


def skewed_logits(probs, rows=R):
    """Rows whose softmax is `probs` (then tiny probabilities for the rest of the vocab)."""
    p = np.full(V, 1e-9)
    p[:len(probs)] = probs
    return np.repeat(np.log(p / p.sum()).astype(np.float32)[None, :], rows, 0)


def log_softmax(logits):
    x = logits.astype(np.float64)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_is_argmax():
    logits = random_logits(R)
    np.testing.assert_array_equal(run(logits, inputs(R)).tokens, logits.argmax(-1))


def test_top_k_1_is_greedy_whatever_the_seed():
    logits = random_logits(BIG, seed=1, scale=0.5)  # flat enough that sampling would wander
    out = run(logits, inputs(BIG, temperature=1.0, top_k=1, seed=np.arange(BIG)))
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    free = run(logits, inputs(BIG, temperature=1.0, seed=np.arange(BIG)))
    assert (free.tokens != logits.argmax(-1)).mean() > 0.5  # so the check above could fail


def test_top_p_keeps_only_the_head():
    logits = skewed_logits([0.5, 0.3, 0.1, 0.05, 0.05])
    # 0.5 < 0.75 so token 1 is needed; 0.5 + 0.3 >= 0.75 so token 2 is not.
    assert kept(logits, inputs(R, temperature=1.0, top_p=0.75))[0].nonzero()[0].tolist() == [0, 1]
    assert kept(logits, inputs(R, temperature=1.0, top_p=0.85))[0].nonzero()[0].tolist() == [0, 1, 2]
    many = skewed_logits([0.5, 0.3, 0.1, 0.05, 0.05], BIG)
    tokens = run(many, inputs(BIG, temperature=1.0, top_p=0.75, seed=np.arange(BIG))).tokens
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).mean() - 0.5 / 0.8) < 0.05  # the head renormalised


def test_top_k_keeps_the_k_largest_and_top_p_one_keeps_all():
    logits = random_logits(R, seed=2)
    assert kept(logits, inputs(R, temperature=1.0)).all()
    mask = kept(logits, inputs(R, temperature=1.0, top_k=np.arange(1, R + 1)))
    for i in range(R):
        assert set(mask[i].nonzero()[0]) == set(np.argsort(-logits[i])[:i + 1])


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = skewed_logits([0.5, 0.3, 0.1, 0.05, 0.05])
    mask = kept(logits, inputs(R, temperature=1.0, min_p=[0.3, 0.15, 0.05, 0, 0, 0, 0, 0]))
    assert mask[0].nonzero()[0].tolist() == [0, 1]  # p >= 0.15
    assert mask[1].nonzero()[0].tolist() == [0, 1, 2]  # p >= 0.075
    assert mask[2].nonzero()[0].tolist() == [0, 1, 2, 3, 4]  # p >= 0.025
    assert mask[3].all()


def test_filters_apply_after_temperature():
    # At temperature 0.25 the head sharpens to about [0.87, 0.11, ...]: top_p 0.75 keeps
    # one token; at temperature 1 it keeps two.
    logits = skewed_logits([0.5, 0.3, 0.1, 0.05, 0.05])
    mask = kept(logits, inputs(R, temperature=[0.25, 1.0] + [1.0] * (R - 2), top_p=0.75))
    assert mask[0].nonzero()[0].tolist() == [0]
    assert mask[1].nonzero()[0].tolist() == [0, 1]


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = random_logits(R + 4, seed=3, scale=0.3)
    row = logits[-1]
    a, b = logits[:R].copy(), logits[4:].copy()  # different neighbours
    a[0], b[R - 2] = row, row
    others = np.arange(R) + 1000
    for index in range(5):
        sa = inputs(R, temperature=1.0, top_p=0.95, seed=np.where(np.arange(R) == 0, 123, others),
                    output_index=index)
        temps = np.linspace(0.0, 2.0, R)
        temps[R - 2] = 1.0
        top_p = np.ones(R)
        top_p[R - 2] = 0.95
        sb = inputs(R, temperature=temps, top_k=np.arange(R) % 3, top_p=top_p,
                    seed=np.where(np.arange(R) == R - 2, 123, others + 7),
                    output_index=np.where(np.arange(R) == R - 2, index, np.arange(R)))
        assert run(a, sa).tokens[0] == run(b, sb).tokens[R - 2], index
    # The token is a function of (seed, output_index): over 16 indices a flat row gives
    # several tokens, and the same ones again.
    drawn = [int(run(a, inputs(R, temperature=1.0, seed=123, output_index=i)).tokens[0])
             for i in range(16)]
    assert len(set(drawn)) > 3
    assert drawn == [int(run(a, inputs(R, temperature=1.0, seed=123, output_index=i)).tokens[0])
                     for i in range(16)]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_follow_softmax_over_temperature(temperature):
    base = np.linspace(2.0, -2.0, V).astype(np.float32)
    logits = np.repeat(base[None], BIG, 0)
    tokens = run(logits, inputs(BIG, temperature=temperature, seed=np.arange(BIG))).tokens
    p = np.exp(base / temperature)
    p /= p.sum()
    freq = np.bincount(tokens, minlength=V) / BIG
    # Each frequency's standard deviation is at most sqrt(0.25 / 2000) = 0.011.
    assert np.abs(freq - p).max() < 0.045, (freq[:4], p[:4])


def reference_processed(logits, history, num_prompt, rep, presence, freq, bias):
    """vLLM's semantics in numpy: repetition penalty over prompt + output tokens, presence and
    frequency penalties over output tokens only, then the additive bias."""
    out = logits.astype(np.float64).copy()
    for i in range(len(history)):
        hist = [t for t in history[i] if t >= 0]
        counts = np.bincount(hist[num_prompt[i]:], minlength=V)
        for t in set(hist):
            out[i, t] = out[i, t] / rep[i] if out[i, t] > 0 else out[i, t] * rep[i]
        out[i] -= freq[i] * counts + presence[i] * (counts > 0)
        for t, b in bias[i].items():
            out[i, t] += b
    return out


def test_penalties_and_bias_match_numpy_reference():
    logits = random_logits(R, seed=5)
    history = np.full((R, 8), -1)
    history[:4] = [[3, 7, 7, 1, 9, 9, 9, -1],  # prompt 3 7 7 | output 1 9 9 9
                   [0, 1, 2, 3, 4, 5, 6, 7],  # all prompt
                   [5, 5, 5, 5, -1, -1, -1, -1],  # prompt 5 | output 5 5 5
                   [-1] * 8]  # nothing seen
    num_prompt = np.array([3, 8, 1, 0, 0, 0, 0, 0])
    rep = np.array([1.3, 0.8, 2.0, 1.5, 1, 1, 1, 1], np.float32)
    presence = np.array([0.5, 1.0, -0.4, 2.0, 0, 0, 0, 0], np.float32)
    freq = np.array([0.7, 1.0, 0.3, -1.0, 0, 0, 0, 0], np.float32)
    bias = [{3: 5.0, 31: -2.5}, {}, {5: 100.0}, {0: -100.0, 10: 1.0}] + [{}] * (R - 4)
    bias_ids = np.full((R, 3), -1, np.int32)
    bias_values = np.zeros((R, 3), np.float32)
    for i, b in enumerate(bias):
        for j, (t, v) in enumerate(b.items()):
            bias_ids[i, j], bias_values[i, j] = t, v
    s = inputs(R, history=history, bias=(bias_ids, bias_values), num_prompt=num_prompt,
               repetition_penalty=rep, presence_penalty=presence, frequency_penalty=freq,
               logprobs=True)
    want = reference_processed(logits, history, num_prompt, rep, presence, freq, bias)
    got = np.asarray(_bias(_penalties(jnp.asarray(logits), s), s))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[4:], logits[4:])  # neutral rows are untouched
    assert not np.allclose(got[:4], logits[:4])
    out = run(logits, s)
    np.testing.assert_array_equal(out.tokens, want.argmax(-1))
    assert out.tokens[2] == 5  # +100 bias wins over the penalties
    # Logprobs are the model's (before penalties and bias), as vLLM returns by default.
    np.testing.assert_allclose(out.logprob, log_softmax(logits)[np.arange(R), out.tokens], atol=1e-5)


def test_logprobs_are_log_softmax_and_top_sorted():
    logits = random_logits(R, seed=7)
    out = run(logits, inputs(R, temperature=np.arange(R) % 2 * 0.8, seed=np.arange(R), logprobs=True))
    ref = log_softmax(logits)
    np.testing.assert_allclose(out.logprob, ref[np.arange(R), out.tokens], atol=1e-5)
    assert out.top_ids.shape == out.top_logprobs.shape == (R, NUM_TOP_LOGPROBS)
    for i in range(R):
        np.testing.assert_array_equal(out.top_ids[i], np.argsort(-ref[i], kind="stable")[:NUM_TOP_LOGPROBS])
        np.testing.assert_allclose(out.top_logprobs[i], ref[i, out.top_ids[i]], atol=1e-5)
        assert (np.diff(out.top_logprobs[i]) <= 0).all()


def test_bias_forces_a_token_for_greedy_and_sampled_rows():
    logits = random_logits(R, seed=8)
    ids = np.full((R, 1), -1, np.int32)
    ids[:2, 0] = [17, 4]
    values = np.where(ids >= 0, 100.0, 0.0).astype(np.float32)
    out = run(logits, inputs(R, bias=(ids, values), temperature=[0.0, 1.0] + [0.0] * (R - 2),
                             seed=np.arange(R)))
    assert out.tokens[:2].tolist() == [17, 4]
    np.testing.assert_array_equal(out.tokens[2:], logits[2:].argmax(-1))


def test_branch_mode_by_backend_and_both_modes_give_the_same_outputs():
    """The GPU's selects and the CPU's conds are one function: same tokens, logprobs and top
    logprobs for every combination of stages a step may need (and none)."""
    from serving.engine.sampler import branch_mode
    assert branch_mode() == ("cond" if jax.default_backend() == "cpu" else "select")
    both = {mode: jax.jit(lambda l, s, mode=mode: sample(l, s, mode=mode)) for mode in ("cond", "select")}
    logits = jnp.asarray(random_logits(R, seed=5))
    history = np.tile(np.arange(4), (R, 1))
    bias = (np.tile([[3, 7, -1]], (R, 1)), np.tile([[5.0, -5.0, 0.0]], (R, 1)))
    cases = [inputs(R), inputs(R, logprobs=True), inputs(R, history=history, repetition_penalty=1.3,
                                                       frequency_penalty=0.5),
             inputs(R, bias=bias), inputs(R, temperature=0.8, seed=np.arange(R)),
             inputs(R, temperature=np.linspace(0, 1.5, R), top_k=3, top_p=0.9, min_p=0.05,
                    seed=np.arange(R), history=history, presence_penalty=0.4, bias=bias,
                    logprobs=True)]
    for i, s in enumerate(cases):
        cond, select = (jax.tree.map(np.asarray, both[m](logits, s)) for m in ("cond", "select"))
        np.testing.assert_array_equal(cond.tokens, select.tokens, err_msg=str(i))
        np.testing.assert_array_equal(cond.top_ids, select.top_ids, err_msg=str(i))
        np.testing.assert_allclose(cond.logprob, select.logprob, rtol=1e-6, err_msg=str(i))
        np.testing.assert_allclose(cond.top_logprobs, select.top_logprobs, rtol=1e-6)
    with pytest.raises(ValueError, match="branch mode"):
        sample(logits, cases[0], mode="maybe")


def test_select_mode_lowers_without_conditionals():
    s = inputs(R, logprobs=True)
    logits = jnp.asarray(random_logits(R))
    assert "stablehlo.case" in jax.jit(lambda l, s: sample(l, s, mode="cond")).lower(logits, s).as_text()
    text = jax.jit(lambda l, s: sample(l, s, mode="select")).lower(logits, s).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
