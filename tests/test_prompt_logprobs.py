"""Prompt logprobs (and output logprobs) equal transformers' log_softmax in float32: on tiny
random models of every family with the default buckets, prompts ending at and around page
boundaries, chunked prefill across chunk boundaries, rows that ask next to rows that do not;
then on the demo model. Nothing compiles after warm-up."""
from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
import torch

from model.checkpoint import convert_hf
from serving import LLM, SamplingParams
from tests.hf_tiny import FAMILIES, tiny_hf_model

PAGE = 16  # the default page size
# Prompts ending just before, at and after page boundaries, and one token long.
LENGTHS = (1, 2, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 2 * PAGE + 1, 47)
# Small maxima keep the default bucket set (derived from them) quick to compile on a CPU.
OPTIONS = dict(max_num_seqs=4, max_model_len=64, progress=False)
TOL = 1e-4  # float32 against transformers' float32 logits, compared in float64


@pytest.fixture(scope="module", autouse=True)
def torch_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's spinning threads slow a small shared CPU down
    yield
    torch.set_num_threads(threads)


_compiles: list[str] = []
_listening = [False]


def _on_event(name, *args, **kwargs):
    if _listening[0] and name.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
        _compiles.append(name)


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_event)


@contextlib.contextmanager
def counting_compilations():
    _compiles.clear()
    _listening[0] = True
    try:
        yield _compiles
    finally:
        _listening[0] = False


def tiny_llm(family: str, tmp_path, **options):
    hf = tiny_hf_model(family, tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "ckpt", "float32", progress=False)
    return hf, LLM(str(tmp_path / "ckpt"), **{**OPTIONS, **options})


def reference(hf, tokens: list[int]) -> np.ndarray:
    """float64 log_softmax of transformers' logits: row i scores token i + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def check_prompt_logprobs(entries, prompt: list[int], want: np.ndarray, k: int,
                          tol: float = TOL) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row = entries[i], want[i - 1]
        target = row[prompt[i]]
        assert e.token_id == prompt[i]
        assert abs(e.logprob - target) < tol, (i, e.logprob, target)
        # 1 + the tokens more likely; within tol, near-ties may fall either way.
        assert 1 + (row > target + tol).sum() <= e.rank <= (row >= target - tol).sum()
        ids = [t for t, _ in e.top]
        vals = [v for _, v in e.top]
        assert len(ids) == k and vals == sorted(vals, reverse=True)
        np.testing.assert_allclose(vals, row[ids], atol=tol)
        assert vals[-1] >= np.sort(row)[-k] - tol  # they are the top k


def check_output_logprobs(result, prompt: list[int], want: np.ndarray,
                          tol: float = TOL) -> None:
    assert len(result.logprobs) == len(result.token_ids)
    for j, lp in enumerate(result.logprobs):
        row = want[len(prompt) - 1 + j]
        assert lp.token_id == result.token_ids[j]
        assert abs(lp.logprob - row[lp.token_id]) < tol


def random_prompts(seed: int, lengths, vocab: int = 211) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_output_logprobs_match_transformers(family, tmp_path):
    hf, llm = tiny_llm(family, tmp_path)
    engine = llm.engine
    assert engine.runner.num_compiled == len(engine.step_shapes)
    prompts = random_prompts(1, LENGTHS)
    k = 5
    asks = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                          prompt_logprobs=k)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # Every other request asks: rows that ask share steps with rows that do not.
    params = [asks if i % 2 == 0 else plain for i in range(len(prompts))] + [asks]
    prompts = prompts + [prompts[1]]  # the odd ones out alone would never ask; this one does
    with counting_compilations() as compiles:
        results = llm.generate(prompts, params)
        alone = [llm.generate([p], plain)[0].token_ids for p in prompts]
    assert compiles == []
    for prompt, p, result, solo in zip(prompts, params, results, alone):
        assert result.token_ids == solo  # asking (or a neighbour asking) changes no token
        if p.prompt_logprobs is None:
            assert result.prompt_logprobs is None and result.logprobs is None
            continue
        want = reference(hf, prompt + result.token_ids)
        check_prompt_logprobs(result.prompt_logprobs, prompt, want, k)
        check_output_logprobs(result, prompt, want)


def test_prompt_logprobs_across_chunk_boundaries(tmp_path):
    """A 16-token budget (the point of this test) splits the prompts into chunks that end
    mid-page and on page edges; a decode runs in the same steps."""
    hf, llm = tiny_llm("llama", tmp_path, max_num_batched_tokens=16)
    prompts = random_prompts(2, (47, 33, 20, 5))
    k = 2
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)] * 3
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    chunked = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        chunked.extend(s.num_new_tokens < s.request.num_prompt_tokens and s.start == 0
                       for s in out.scheduled)
        return out

    llm.engine.scheduler.schedule = recording
    with counting_compilations() as compiles:
        results = llm.generate(prompts, params)
    llm.engine.scheduler.schedule = schedule
    assert compiles == [] and any(chunked)
    for prompt, result in zip(prompts[:3], results):
        check_prompt_logprobs(result.prompt_logprobs, prompt, reference(hf, prompt), k)
    assert results[3].prompt_logprobs is None


def test_max_logprobs_caps_requests(tmp_path):
    _, llm = tiny_llm("qwen2", tmp_path, max_logprobs=3)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} must be at most 3"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, **{name: 4}))
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert [len(e.top) for e in out.prompt_logprobs[1:]] == [3, 3]


@pytest.mark.slow
def test_demo_model_prompt_logprobs_match_transformers(demo_llm, demo_model_dir):
    """The demo model (its engine's 32-token budget chunks this 70-token prompt)."""
    import transformers
    demo = demo_llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir,
                                                           dtype=torch.float32).eval()
    text = ("Question: which planet is known as the red planet? Answer: Mars. Question: what "
            "is the boiling point of water at sea level in degrees Celsius? Answer: 100.")
    prompt = demo.tokenizer.encode(text)
    assert len(prompt) > 32
    [out] = demo.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, logprobs=1,
                                                  prompt_logprobs=3))
    want = reference(hf, prompt + out.token_ids)
    # 30 layers in float32 agree with transformers to ~1e-4 (test_engine).
    check_prompt_logprobs(out.prompt_logprobs, prompt, want, 3, tol=1e-3)
    check_output_logprobs(out, prompt, want, tol=1e-3)


@pytest.mark.slow
def test_lm_eval_requests_through_the_server(shared_server, demo_model_dir):
    """What lm-evaluation-harness's local-completions sends for a loglikelihood: token-id
    prompts, several per request, echo, logprobs 1, max_tokens 1 (and 0, as some clients
    send); the prompt's token_logprobs are transformers' and its greediness test holds. The
    server's 64-token budget chunks the longer prompt."""
    import transformers
    from tests.server_util import MODEL, post
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir,
                                                           dtype=torch.float32).eval()
    tok = shared_server.tokenizer
    contexts = ["Question: What is the capital of France?\nAnswer: Paris",
                "A page of the KV cache holds sixteen tokens of keys and values. " * 4
                + "How many tokens does a page hold? Sixteen"]
    prompts = [tok.encode(c) for c in contexts]
    assert len(prompts[1]) > 64
    for max_tokens in (1, 0):
        status, body = post(shared_server.port, "/v1/completions", {
            "model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1,
            "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
        assert status == 200, body
        choices = sorted(body["choices"], key=lambda c: c["index"])
        for ids, choice in zip(prompts, choices):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + max_tokens
            assert choice["text"].startswith(tok.decode(ids))
            want = reference(hf, ids)
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for i in range(1, len(ids)):
                got, top = lp["token_logprobs"][i], lp["top_logprobs"][i]
                row = want[i - 1]
                assert abs(got - row[ids[i]]) < 1e-3, (i, got, row[ids[i]])
                margin = np.sort(row)[-1] - np.sort(row)[-2]
                if margin > 1e-3:  # lm-eval's is_greedy: the token's logprob is the top one
                    assert (got == max(top.values())) == (row.argmax() == ids[i])
        assert body["usage"]["completion_tokens"] == 2 * max_tokens
    shared_server.wait_idle()
