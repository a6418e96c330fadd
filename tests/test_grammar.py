"""Structured outputs on the host (serving/core/grammar.py) with the demo model's tokenizer:
compiling and its cache, refusals, the matcher's bitmask and EOS rule, how a constrained
request ends in the scheduler, min_tokens, and the device op against a numpy reference."""
from __future__ import annotations

import numpy as np
import pytest

from serving.core import grammar as g
from serving.core.request import Request, RequestStatus
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import ScheduledRequest
from serving.core.structured_outputs import StructuredOutputsParams as SO
from tests.test_scheduler import make_scheduler, step

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(demo_model_dir))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return g.GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def walk(compiler, tokenizer, so, text):
    """Feeds text's tokens through a fresh matcher, checking each was allowed."""
    m = compiler.matcher(so)
    for t in tokenizer.encode(text, add_special_tokens=False):
        compiler.fill([m])
        assert allowed(m.bitmask, t), (text, t)
        m.accept(t)
    if m.needs_fill:
        compiler.fill([m])
    return m


def test_a_constraint_compiles_once_and_the_cache_is_bounded(tokenizer):
    c = g.GrammarCompiler(tokenizer, len(tokenizer), [EOS], max_cached=2)
    first = c.get(SO(regex="a+"))
    assert c.get(SO(regex="a+")) is first
    # Key order does not matter for a schema: the key is its canonical JSON.
    assert c.get(SO(json={"type": "object", "required": []})) is c.get(
        SO(json={"required": [], "type": "object"}))
    c.get(SO(regex="b+"))
    assert c.num_cached == 2 and c.get(SO(regex="a+")) is not first  # evicted, rebuilt


@pytest.mark.parametrize("so,words", [
    (SO(regex="[a-"), "regex"),
    (SO(json={"type": "strin"}), "json"),
    (SO(json={"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
     "json"),
    (SO(json={"$ref": "http://example.com/schema.json"}), "json"),
    (SO(grammar="start: undefined_rule"), "grammar"),
    (SO(regex="a" * (g.MAX_GRAMMAR_CHARS + 1)), "characters"),
])
def test_bad_constraints_are_refused_and_the_refusal_is_cached(compiler, so, words):
    with pytest.raises(g.GrammarRefused, match=words) as first:
        compiler.get(so)
    with pytest.raises(g.GrammarRefused) as again:
        compiler.get(so)
    assert again.value is first.value


def test_a_compile_over_the_time_limit_is_refused(tokenizer):
    c = g.GrammarCompiler(tokenizer, len(tokenizer), [EOS], timeout_s=0.0)
    with pytest.raises(g.GrammarRefused, match="took"):
        c.get(SO(json={"type": "object"}))


def test_submit_compiles_on_the_compiler_thread(compiler):
    import threading
    main = threading.get_ident()
    seen = []
    original = compiler._compile
    compiler._compile = lambda so: seen.append(threading.get_ident()) or original(so)
    try:
        compiler.submit(SO(regex="submitted[0-9]")).result(30)
    finally:
        compiler._compile = original
    assert seen and seen[0] != main


def test_bitmask_allows_valid_tokens_and_eos_exactly_when_accepting(compiler, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    m = compiler.matcher(SO(json=schema))
    compiler.fill([m])
    assert not allowed(m.bitmask, EOS)
    assert not allowed(m.bitmask, tokenizer.encode("hello", add_special_tokens=False)[0])
    m = walk(compiler, tokenizer, SO(json=schema), '{"n": 12')
    assert not allowed(m.bitmask, EOS) and not m.is_terminated
    m = walk(compiler, tokenizer, SO(regex="[0-9]+"), "12")
    assert allowed(m.bitmask, EOS) and not m.is_terminated  # more digits could follow
    assert m.bitmask.shape == (g.bitmask_width(len(tokenizer)),)


def test_a_complete_grammar_with_nothing_left_terminates(compiler, tokenizer):
    m = walk(compiler, tokenizer, SO(choice=["yes", "no"]), "yes")
    assert m.is_terminated and not m.needs_fill


def test_a_refused_token_is_an_error(compiler, tokenizer):
    m = compiler.matcher(SO(regex="[0-9]+"))
    m.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert m.error and not m.is_terminated


# -- the scheduler: how constrained requests end ---------------------------------------------

def _constrained(compiler, so, max_tokens, **params) -> Request:
    req = Request("r", [100, 101, 102], SamplingParams(max_tokens=max_tokens, **params),
                  eos_token_ids=frozenset({EOS}))
    req.grammar = compiler.matcher(so)
    compiler.fill([req.grammar])
    return req


def _run(compiler, req, tokens):
    sched = make_scheduler()
    sched.add_request(req)
    for t in tokens:
        if not sched.has_unfinished:
            break
        _, changed = step(sched, token=t)
        g.advance(compiler, changed)
    return sched


def test_the_grammar_ends_a_request_with_stop_when_complete(compiler, tokenizer):
    ids = tokenizer.encode("no", add_special_tokens=False)
    req = _constrained(compiler, SO(choice=["yes", "no"]), max_tokens=50, ignore_eos=True)
    sched = _run(compiler, req, ids + [7, 7])
    assert req.output_token_ids == ids and req.status is RequestStatus.FINISHED_STOPPED
    assert sched.allocator.num_used_pages == 0
    # Complete at exactly max_tokens: the output is whole, so still "stop".
    req = _constrained(compiler, SO(choice=["yes", "no"]), max_tokens=len(ids))
    _run(compiler, req, ids)
    assert req.finish_reason == "stop"


def test_max_tokens_before_the_grammar_is_complete_is_length(compiler, tokenizer):
    ids = tokenizer.encode('{"a": 1}', add_special_tokens=False)
    req = _constrained(compiler, SO(json_object=True), max_tokens=2)
    _run(compiler, req, ids)
    assert (req.output_token_ids, req.finish_reason) == (ids[:2], "length")


def test_min_tokens_holds_back_eos_and_stop_tokens():
    sched = make_scheduler()
    req = Request("m", [100, 101], SamplingParams(max_tokens=10, min_tokens=3,
                                                  stop_token_ids=[9]),
                  eos_token_ids=frozenset({EOS}))
    sched.add_request(req)
    for t in [EOS, 9, EOS, 9, 5]:
        if sched.has_unfinished:
            step(sched, token=t)
    assert req.output_token_ids == [EOS, 9, EOS, 9] and req.stop_reason == 9


def test_step_bitmask_rows(compiler):
    def sr(req, samples=True):
        return ScheduledRequest(req, 1, 0, [1], samples)

    free = Request("f", [1], SamplingParams(max_tokens=4), eos_token_ids=frozenset({EOS}))
    assert g.step_bitmask([sr(free)], 4, 8) is None  # nothing constrained: nothing sent
    held = Request("h", [1], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[40]),
                   eos_token_ids=frozenset({EOS}))
    grammar = _constrained(compiler, SO(regex="[0-9]"), 4)
    mask = g.step_bitmask([sr(free), sr(held), sr(grammar, samples=False)], 4, 8)
    assert mask.shape == (4, 8) and (mask[[0, 2, 3]] == -1).all()  # only row 1 is constrained
    row = mask[1]
    assert not allowed(row, EOS) and not allowed(row, 40)
    assert all(allowed(row, t) for t in range(256) if t not in (EOS, 40))


# -- the device op ---------------------------------------------------------------------------

def test_apply_token_bitmask_matches_numpy():
    import jax.numpy as jnp
    from serving.engine.token_bitmask import apply_token_bitmask
    logits, bits, mask = _random_mask(3, 77)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, np.where(bits, logits, -np.inf))


def _random_mask(R, V, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(R, V)).astype(np.float32)
    bits = rng.random((R, V)) < 0.3
    bits[:, 0] = True  # every row allows something
    mask = np.full((R, g.bitmask_width(V)), -1, np.int32)
    for r in range(R):
        for t in range(V):
            g.set_bit(mask[r], t, bool(bits[r, t]))
    return logits, bits, mask


def test_sampler_masks_greedy_and_sampled_rows_and_their_logprobs():
    import dataclasses
    import jax.numpy as jnp
    from tests.test_sampler import inputs, run
    R, V = 4, 77
    logits, bits, mask = _random_mask(R, V, seed=1)
    masked_logits = np.where(bits, logits, -np.inf)
    s = dataclasses.replace(inputs(R, temperature=[0.0, 0.0, 1.0, 1.0], seed=[1, 2, 3, 4],
                                   logprobs=True),
                            any_masked=np.bool_(True), token_bitmask=jnp.asarray(mask))
    out = run(logits, s)
    assert all(bits[r, out.tokens[r]] for r in range(R))
    np.testing.assert_array_equal(out.tokens[:2], masked_logits[:2].argmax(-1))
    shifted = masked_logits - masked_logits.max(-1, keepdims=True)
    want = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # constrained log-softmax
    np.testing.assert_allclose(out.logprob, want[np.arange(R), out.tokens], rtol=1e-5)
    # The same bitmask with any_masked false changes nothing.
    free = run(logits, dataclasses.replace(s, any_masked=np.bool_(False)))
    unmasked = run(logits, dataclasses.replace(s, token_bitmask=None))
    np.testing.assert_array_equal(free.tokens, unmasked.tokens)
    assert not all(bits[r, unmasked.tokens[r]] for r in range(R))  # the mask mattered


def test_structural_tag_constrains_only_inside_the_tag(compiler, tokenizer):
    import json
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    so = SO(structural_tag=json.dumps({
        "structures": [{"begin": "<function=f>", "schema": schema, "end": "</function>"}],
        "triggers": ["<function="]}))
    m = walk(compiler, tokenizer, so, 'Sure. <function=f>{"a": 1}</function> done')
    assert m.error is None
    m = compiler.matcher(so)
    ids = tokenizer.encode('x <function=f>{"b"', add_special_tokens=False)
    for t in ids[:-1]:
        compiler.fill([m])
        m.accept(t)
    compiler.fill([m])
    assert not allowed(m.bitmask, ids[-1])  # '"b"' breaks the schema inside the tag


@pytest.mark.parametrize("tag", [{"structures": "x", "triggers": []},
                                 {"structures": [{"begin": 5, "end": ""}], "triggers": ["<"]},
                                 {"structures": [{"begin": "<a>", "end": "</a>"}],
                                  "triggers": ["<b"]}, [1, 2]])
def test_malformed_structural_tags_are_refused(compiler, tag):
    import json
    with pytest.raises(g.GrammarRefused):
        compiler.get(SO(structural_tag=json.dumps(tag)))


def test_a_choice_the_tokenizer_cannot_write_is_refused(compiler, tokenizer):
    assert tokenizer.decode(tokenizer.encode("a\x1db", add_special_tokens=False)) != "a\x1db"
    with pytest.raises(g.GrammarRefused, match="cannot write"):
        compiler.get(SO(choice=["ok", "a\x1db"]))
    compiler.get(SO(choice=["ok", "naïve 🙂"]))


def test_a_regex_character_the_tokenizer_cannot_write_is_refused(compiler, tokenizer):
    """Forced, such a character's first byte passes the mask and the next token is refused:
    the request would fail mid-generation. It is refused before it is queued."""
    unwritable = "\U00040000"
    assert tokenizer.decode(tokenizer.encode(unwritable, add_special_tokens=False)) != unwritable
    for so in (SO(regex=unwritable), SO(regex=f"a[{unwritable}b]"),
               SO(grammar=f'start: "x{unwritable}"')):
        with pytest.raises(g.GrammarRefused, match="cannot write the character"):
            compiler.get(so)
    compiler.get(SO(regex="naïve 🙂[a-z]+"))


def test_extra_slices_leave_masks_unchanged(tokenizer, compiler):
    """Our slices (bounded JSON strings) only speed the fill: every mask along documents with
    strings of every length under their maxLength equals llguidance's without any slice."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 23}, "tag": {"type": "string", "minLength": 3,
                                                             "maxLength": 9}},
        "required": ["name", "tag"], "additionalProperties": False}
    so = SO(json=schema)
    plain_tok = llguidance.hf.from_tokenizer(tokenizer, len(tokenizer), eos_token=EOS, slices=[])
    plain = llguidance.LLMatcher(plain_tok, g.grammar_text(so), log_level=0)
    want = np.zeros((1, compiler.width), np.int32)
    rng = np.random.default_rng(0)
    letters = list("abcdefghij klmnopqrstuvwxyz") + ["é", "Zü", "42"]
    for n in (0, 1, 5, 9, 16, 22, 23):
        name = "".join(rng.choice(letters, n))[:23]
        text = '{"name": "%s", "tag": "%s"}' % (name, "x" * (3 + n % 7))
        ours, ref = compiler.matcher(so), plain.deep_copy()
        for t in tokenizer.encode(text, add_special_tokens=False):
            compiler.fill([ours])
            lnp.fill_next_token_bitmask(ref, want)
            g.GrammarMatcher(ref, compiler).set_bitmask(want[0])  # the same EOS rule
            np.testing.assert_array_equal(ours.bitmask, want[0])
            assert allowed(ours.bitmask, t)
            ours.accept(t)
            assert ref.consume_token(t)
