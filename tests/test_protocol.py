"""OpenAI protocol: request validation, SamplingParams mapping and response shapes; then the
aiohttp server against a fake engine (SSE framing, n > 1, usage, errors, disconnects,
metrics, drain). The fake engine "generates" the prompt's tokens in reverse."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from serving.openai import protocol as p
from serving.openai import responses
from serving.openai.api_server import build_app, run_server
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.core.outputs import RequestOutput, TokenLogprob
from serving.core.sampling_params import SamplingParams
from serving.core.config import EngineConfig

MODEL = "tiny-test"


# -- request validation ----------------------------------------------------------------

def _err(fn, *args):
    with pytest.raises(p.ProtocolError) as info:
        fn(*args)
    return info.value


def _completion(**fields):
    return p.parse_completion_request({"model": MODEL, "prompt": "hi", **fields}, 128)


def _chat(**fields):
    return p.parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                 **fields})


COMMON_BAD = [  # (field, value, param): rejected by both endpoints
    ("temperature", "0.5", "temperature"), ("temperature", True, "temperature"),
    ("temperature", float("nan"), "temperature"), ("temperature", float("inf"), "temperature"),
    ("temperature", -0.1, "temperature"), ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"), ("top_k", 2.5, "top_k"), ("min_p", 1.5, "min_p"),
    ("n", 0, "n"), ("n", True, "n"), ("n", 1000, "n"), ("seed", "1", "seed"),
    ("seed", 1.5, "seed"), ("seed", 2 ** 70, "seed"), ("max_tokens", 0, "max_tokens"),
    ("max_tokens", "10", "max_tokens"), ("max_tokens", False, "max_tokens"),
    ("stop", 5, "stop"), ("stop", [""], "stop"), ("stop", ["a"] * 17, "stop"),
    ("stop", ["a", 1], "stop"), ("stop_token_ids", [1, -1], "stop_token_ids"),
    ("stop_token_ids", "1", "stop_token_ids"), ("presence_penalty", 3, "presence_penalty"),
    ("frequency_penalty", -2.5, "frequency_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"), ("logit_bias", [1], "logit_bias"),
    ("logit_bias", {"abc": 1}, "logit_bias"), ("logit_bias", {"5": 101}, "logit_bias"),
    ("logit_bias", {"5": "1"}, "logit_bias"), ("logit_bias", {"5": True}, "logit_bias"),
    ("ignore_eos", 1, "ignore_eos"), ("stream", "true", "stream"),
    ("stream_options", {"include_usage": True}, "stream_options"),  # without stream
    ("model", 3, "model"), ("best_of", 3, "best_of"),
    ("skip_special_tokens", False, "skip_special_tokens"),
    ("cache_salt", "", "cache_salt"), ("cache_salt", 7, "cache_salt"),
]


@pytest.mark.parametrize("field,value,param", COMMON_BAD)
@pytest.mark.parametrize("parse", [_completion, _chat])
def test_bad_field_rejected(parse, field, value, param):
    err = _err(lambda: parse(**{field: value}))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert err.to_dict() == {"error": {"message": err.message, "type": "invalid_request_error",
                                       "param": param, "code": err.code}}
    assert param in err.message


@pytest.mark.parametrize("fields,param", [
    ({"prompt": None}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [1, -3]}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"suffix": "x"}, "suffix"), ({"prompt": ["a"] * 200, "n": 2}, "n"),
    ({"prompt": list(range(100)), "max_tokens": 29}, "max_tokens"),
    ({"prompt": list(range(128))}, "prompt"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ({"stream": True, "stream_options": [1]}, "stream_options"),
])
def test_bad_completion_request(fields, param):
    body = {"model": MODEL, "prompt": "hi", **fields}
    if body["prompt"] is None:
        del body["prompt"]
    err = _err(p.parse_completion_request, body, 128)
    assert (err.status, err.param) == (400, param)


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": ["hi"]}, "messages"),
    ({"logprobs": 1}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages"),  # unhashable role
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_chat_request(fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    err = _err(p.parse_chat_request, body)
    assert (err.status, err.param) == (400, param)


def test_echo_and_prompt_logprobs_map_to_sampling_params():
    req = _completion(prompt=[[5, 6, 7]], echo=True, logprobs=2, max_tokens=0)
    # The prompt's entries need the same top k; echo without generation samples one token
    # that the response drops.
    assert (req.echo, req.echo_only, req.params.max_tokens) == (True, True, 1)
    assert (req.params.logprobs, req.params.prompt_logprobs, req.prompt_logprobs) == (2, 2, None)
    req = _completion(echo=True, logprobs=1, prompt_logprobs=4, max_tokens=3)
    assert (req.echo_only, req.params.max_tokens, req.params.prompt_logprobs) == (False, 3, 4)
    req = _completion(prompt_logprobs=0)
    assert (req.params.logprobs, req.params.prompt_logprobs, req.prompt_logprobs) == (None, 0, 0)
    assert _completion(echo=True).params.prompt_logprobs is None  # echo alone scores nothing
    chat = p.parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                                 "prompt_logprobs": 3})
    assert (chat.prompt_logprobs, chat.params.prompt_logprobs) == (3, 3)
    # --max-logprobs moves the cap on all three.
    wide = p.parse_completion_request({"prompt": "x", "logprobs": 30, "prompt_logprobs": 40,
                                       "echo": True}, 128, max_logprobs=50)
    assert (wide.params.logprobs, wide.params.prompt_logprobs) == (30, 40)
    assert _err(p.parse_completion_request, {"prompt": "x", "logprobs": 3}, 128, 2).param == \
        "logprobs"


def test_integral_numbers_are_integers_as_json_schema_counts_them():
    req = _completion(prompt=[5.0, 6], n=2.0, seed=7.0, stop_token_ids=[3.0], max_tokens=4.0)
    assert req.prompts == [[5, 6]] and all(type(t) is int for t in req.prompts[0])
    assert (req.params.n, req.params.seed, req.params.stop_token_ids, req.params.max_tokens) \
        == (2, 7, [3], 4)
    assert type(req.params.n) is int and type(req.params.seed) is int


def test_body_must_be_an_object():
    assert _err(p.parse_chat_request, [1]).status == 400
    assert _err(p.parse_completion_request, "x", 10).status == 400


def test_completion_request_maps_to_sampling_params():
    req = _completion(prompt=["a", "b"], max_tokens=7, temperature=0, top_p=0.9, top_k=-1,
                      min_p=0.1, n=3, seed=5, stop="END", stop_token_ids=[2],
                      presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                      logit_bias={"7": -100, "9": 2.5}, logprobs=2, ignore_eos=True,
                      stream=True, stream_options={"include_usage": True}, user="u",
                      some_future_field={"x": 1}, cache_salt="tenant-1")
    assert req.prompts == ["a", "b"] and req.stream and req.include_usage and not req.echo
    assert req.params == SamplingParams(
        n=3, temperature=0.0, top_p=0.9, top_k=0, min_p=0.1, seed=5, max_tokens=7,
        stop=["END"], stop_token_ids=[2], ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={7: -100.0, 9: 2.5},
        logprobs=2, cache_salt="tenant-1")
    assert _chat(cache_salt="s").params.cache_salt == "s"
    assert _completion().params == SamplingParams(max_tokens=16)
    assert _completion(prompt=[1, 2]).prompts == [[1, 2]]
    assert _completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    assert _completion(echo=True).echo


def test_chat_request_maps_to_sampling_params():
    req = _chat(messages=[{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None}],
                max_tokens=3, max_completion_tokens=9, logprobs=True, top_logprobs=4)
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": ""}]
    assert req.params.max_tokens == 9 and req.max_tokens_param == "max_completion_tokens"
    assert req.params.logprobs == 4 and req.logprobs and req.top_logprobs == 4
    assert _chat(logprobs=True).params.logprobs == 0
    assert _chat().params == SamplingParams(max_tokens=None)
    assert _chat(max_tokens=5).params.max_tokens == 5


def test_check_context():
    assert p.check_context(10, None, 64) == 54
    assert p.check_context(10, 54, 64) == 54
    err = _err(p.check_context, 10, 55, 64)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    err = _err(lambda: p.check_context(64, None, 64, prompt_param="messages"))
    assert (err.code, err.param) == ("context_length_exceeded", "messages")


def test_response_shapes():
    u = responses.usage(3, 4)
    assert u == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    rid = responses.new_id("chatcmpl")
    assert rid.startswith("chatcmpl-") and len(rid) > 20
    resp = responses.chat_response(rid, MODEL, 1, [responses.chat_choice(0, "hey", "stop")], u)
    assert resp["object"] == "chat.completion" and resp["usage"] == u
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    chunk = responses.chat_chunk(rid, MODEL, 1, 1, {"content": "x"}, include_usage=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert chunk["choices"][0] == {"index": 1, "delta": {"content": "x"}, "logprobs": None,
                                   "finish_reason": None}
    c = responses.completion_chunk("cmpl-1", MODEL, 1, 0, "t", "length")
    assert c["object"] == "text_completion" and c["choices"][0]["finish_reason"] == "length"
    assert "usage" not in c
    last = responses.usage_chunk("text_completion", "cmpl-1", MODEL, 1, u)
    assert last["choices"] == [] and last["usage"] == u
    entries = [responses.LogprobEntry("ab", [97, 98], -0.1, [("ab", [97, 98], -0.1), ("c", [99], -2.0)]),
               responses.LogprobEntry("d", [100], -0.5, [])]
    assert responses.completion_logprobs(entries, 3) == {
        "tokens": ["ab", "d"], "token_logprobs": [-0.1, -0.5],
        "top_logprobs": [{"ab": -0.1, "c": -2.0}, {}], "text_offset": [3, 5]}
    assert responses.chat_logprobs(entries[:1]) == {"content": [
        {"token": "ab", "logprob": -0.1, "bytes": [97, 98],
         "top_logprobs": [{"token": "ab", "logprob": -0.1, "bytes": [97, 98]},
                          {"token": "c", "logprob": -2.0, "bytes": [99]}]}]}


def test_host_modules_import_no_jax_or_aiohttp():
    code = ("import sys, serving.openai.protocol, serving.openai.responses, serving.engine.detokenizer, "
            "serving.openai.metrics; "
            "bad = [m for m in ('jax', 'aiohttp') if m in sys.modules]; "
            "assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# -- fake engine -----------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = "hello world the quick brown fox jumps over lazy dog 你好 🙂 café".split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(8)) for i in range(100)]
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = TEMPLATE
    return hf


@dataclass
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.25
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec: object = None  # speculative decoding off


class FakeEngine:
    """Outputs the prompt ids reversed, one token per update, detokenized with stop strings
    like the real engine. Records every request and every abort."""

    def __init__(self, tokenizer, max_model_len=64):
        self.tokenizer, self.max_model_len, self.ready = tokenizer, max_model_len, True
        self.vocab_size = len(tokenizer)
        self.max_logprobs = 20
        self.requests, self.aborted, self.finished = [], [], []
        self.stats_ = Stats()
        self.block_after = None  # stop producing after this many tokens, until aborted
        self.fail_after = None  # yield an engine error after this many tokens
        self.aborted_event = asyncio.Event()
        self.hold = None  # (entered, gate) events: a request waits for the gate before its output
        self.script = None  # token ids every request outputs instead of its reversed prompt
        self.config, self.num_pages, self.model_dir = EngineConfig(), 65, "fake-model-dir"
        self.task = "generate"
        self.reset_ok = True  # what reset_prefix_cache answers (False: requests running)

    def stats(self):
        return self.stats_

    def replica_stats(self):
        return [self.stats()]

    async def reset_prefix_cache(self):
        return self.reset_ok

    def abort(self, request_id):
        self.aborted.append(request_id)

    def generate(self, prompt_token_ids, params, request_id, queue):
        """Like AsyncEngine.generate: (request_id, output or exception) items into queue;
        the n samples one after another, each ending with a finished output."""
        stream = FakeStream(self, request_id)
        stream.task = asyncio.create_task(self._produce(prompt_token_ids, params, request_id,
                                                        queue, stream))
        return stream

    async def _produce(self, prompt_token_ids, params, request_id, queue, stream):
        if params.max_tokens > 1000:
            queue.put_nowait((request_id, ValueError("the scheduler refuses this request")))
            return
        self.requests.append((request_id, list(prompt_token_ids), params))
        if self.hold is not None:
            self.hold[0].set()
            await self.hold[1].wait()
        for index in range(params.n):
            if not await self._sample(prompt_token_ids, params, request_id, queue, index):
                stream.ended = True
                return
        stream.ended = True
        self.finished.append(request_id)

    async def _sample(self, prompt_token_ids, params, request_id, queue, index) -> bool:
        """One sample's outputs; False if it ended in an error."""
        out_ids = list(self.script if self.script is not None
                       else reversed(prompt_token_ids))[:params.max_tokens]
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                       params.include_stop_str_in_output)
        for k, tid in enumerate(out_ids):
            if k == self.block_after:
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            if k == self.fail_after:
                queue.put_nowait((request_id, RequestOutput(
                    request_id, prompt_token_ids, finished=True, finish_reason="error",
                    error="device on fire", index=index)))
                return False
            new_text, stop = detok.add([tid])
            last = stop is not None or k == len(out_ids) - 1
            if last and stop is None:
                new_text += detok.flush()
            prompt_lps = None
            if params.prompt_logprobs is not None and k == 0:  # i-th token: -i / 10
                prompt_lps = [None] + [
                    TokenLogprob(t, -i / 10, [(t, -i / 10), (0, -5.0)][:params.prompt_logprobs],
                                 rank=1) for i, t in enumerate(prompt_token_ids[1:], 1)]
            new_lp = None
            if params.logprobs is not None:
                top = [(tid, -0.5), (0, -1.5), (1, -2.5)][:params.logprobs]
                new_lp = [TokenLogprob(tid, -0.5, top)]
            queue.put_nowait((request_id, RequestOutput(
                request_id, prompt_token_ids, [tid], new_text, new_lp, finished=last,
                # A scripted output ends as if the model wrote EOS after it.
                finish_reason=("stop" if stop or self.script is not None else "length")
                if last else None,
                stop_reason=stop, prompt_logprobs=prompt_lps, index=index)))
            if last:
                return True
        return True


class FakeStream:
    """What FakeEngine.generate returns: closing it before its end aborts the request."""

    def __init__(self, engine, request_id):
        self.engine, self.request_id, self.task, self.ended = engine, request_id, None, False
        self.closed = False

    def take(self, item):
        pass

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.task.cancel()
        if not self.ended:
            self.engine.abort(self.request_id)
            self.engine.aborted_event.set()


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@asynccontextmanager
async def serve(engine, **kwargs):
    app = build_app(engine, served_model_name=MODEL, **kwargs)
    async with TestClient(TestServer(app)) as client:
        yield client


def reversed_text(tokenizer, text, n):
    ids = tokenizer.encode(text)
    return tokenizer.decode(list(reversed(ids))[:n], skip_special_tokens=True)


async def sse_events(resp):
    """Parses an SSE body strictly: only `data: ...` events separated by blank lines."""
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


# -- server ------------------------------------------------------------------------------

def test_completions_non_stream(engine, tokenizer):
    async def go():
        async with serve(engine) as client:
            r = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": ["hello world", "the fox"], "max_tokens": 4, "n": 2,
                "seed": 7, "temperature": 0.5})
            assert r.status == 200
            body = await r.json()
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert body["model"] == MODEL and isinstance(body["created"], int)
            texts = [reversed_text(tokenizer, t, 4) for t in ("hello world", "the fox")]
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            assert [c["text"] for c in body["choices"]] == [texts[0]] * 2 + [texts[1]] * 2
            assert all(c["finish_reason"] == "length" for c in body["choices"])
            n_prompt = [len(tokenizer.encode(t)) for t in ("hello world", "the fox")]
            assert body["usage"] == responses.usage(sum(n_prompt), sum(min(4, n) * 2 for n in n_prompt))
            # one engine request per prompt; the engine runs its n samples
            assert [(prm.n, prm.seed) for _, _, prm in engine.requests] == [(2, 7), (2, 7)]
            assert len({rid for rid, _, _ in engine.requests}) == 2
    run(go())


def test_completions_token_prompt_echo_and_stop(engine, tokenizer):
    async def go():
        async with serve(engine) as client:
            ids = tokenizer.encode("the quick brown fox")
            r = await client.post("/v1/completions", json={"prompt": ids, "echo": True,
                                                           "max_tokens": 50})
            body = await r.json()
            expected = tokenizer.decode(ids) + reversed_text(tokenizer, "the quick brown fox", 50)
            assert body["choices"][0]["text"] == expected
            full = reversed_text(tokenizer, "the quick brown fox", 50)
            stop = full[3:6]
            r = await client.post("/v1/completions", json={"prompt": "the quick brown fox",
                                                           "stop": [stop], "max_tokens": 50})
            choice = (await r.json())["choices"][0]
            assert choice["text"] == full[:full.index(stop)]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    run(go())


def test_completions_echo_with_logprobs_covers_prompt_then_completion(engine, tokenizer):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, token-id prompts in
    one batch; then max_tokens 0 (the prompt alone) and the stream."""
    texts = sse_texts(tokenizer)
    prompts = [tokenizer.encode("the quick brown fox"), tokenizer.encode("hello world")]

    async def go():
        async with serve(engine) as client:
            r = await client.post("/v1/completions", json={
                "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                "temperature": 0})
            body = await r.json()
            assert [c["index"] for c in body["choices"]] == [0, 1]
            for ids, choice in zip(prompts, body["choices"]):
                lp = choice["logprobs"]
                out = list(reversed(ids))[:1]
                assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode(out)
                assert lp["tokens"] == [texts.get(t)[0] for t in ids + out]
                # The fake's i-th prompt token has logprob -i/10; its completion token -0.5.
                assert lp["token_logprobs"] == [None] + [-i / 10 for i in range(1, len(ids))] + [-0.5]
                assert lp["top_logprobs"][0] is None
                assert lp["top_logprobs"][1] == {texts.get(ids[1])[0]: -0.1}
                lengths = [len(t) for t in lp["tokens"]]
                want = [sum(lengths[:i]) for i in range(len(ids))]
                want += [len(tokenizer.decode(ids))]
                assert lp["text_offset"] == want
                assert "prompt_logprobs" not in choice  # only when asked for by name
            assert body["usage"]["completion_tokens"] == 2
            # max_tokens 0: the prompt alone, its logprobs, nothing generated.
            r = await client.post("/v1/completions", json={
                "prompt": prompts[0], "echo": True, "logprobs": 0, "max_tokens": 0})
            body = await r.json()
            choice = body["choices"][0]
            assert choice["text"] == tokenizer.decode(prompts[0])
            assert len(choice["logprobs"]["tokens"]) == len(prompts[0])
            assert choice["logprobs"]["top_logprobs"][1] == {}
            assert body["usage"]["completion_tokens"] == 0
            assert engine.requests[-1][2].max_tokens == 1  # one token sampled, then dropped
            # Streaming: the echo arrives with the first update, which carries the prompt's.
            r = await client.post("/v1/completions", json={
                "prompt": prompts[1], "echo": True, "logprobs": 1, "max_tokens": 3,
                "stream": True})
            chunks = [e["choices"][0] for e in await sse_events(r)]
            out = list(reversed(prompts[1]))[:3]
            assert "".join(c["text"] for c in chunks) == tokenizer.decode(prompts[1]) + \
                tokenizer.decode(out)
            tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
            assert tokens == [texts.get(t)[0] for t in prompts[1] + out]
            first = chunks[0]["logprobs"]
            assert first["token_logprobs"][0] is None and first["text_offset"][0] == 0
    run(go())


def test_prompt_logprobs_field_as_vllm_returns_it(engine, tokenizer):
    texts = sse_texts(tokenizer)
    ids = tokenizer.encode("the quick brown fox")

    async def go():
        async with serve(engine) as client:
            r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2,
                                                           "prompt_logprobs": 2})
            choice = (await r.json())["choices"][0]
            assert choice["logprobs"] is None  # no completion logprobs were asked
            pl = choice["prompt_logprobs"]
            assert len(pl) == len(ids) and pl[0] is None
            assert pl[1] == {str(ids[1]): {"logprob": -0.1, "rank": 1,
                                           "decoded_token": texts.get(ids[1])[0]},
                             "0": {"logprob": -5.0, "rank": 2, "decoded_token": texts.get(0)[0]}}
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "prompt_logprobs": 0})
            body = await r.json()
            chat_ids = engine.requests[-1][1]
            assert [None if e is None else list(e) for e in body["prompt_logprobs"]] == \
                [None] + [[str(t)] for t in chat_ids[1:]]
            assert body["choices"][0]["logprobs"] is None
    run(go())


def test_tokenizer_info_serves_lm_eval_remote_tokenizer(engine, tokenizer):
    """lm-evaluation-harness uses a server's tokenizer when GET /tokenizer_info has
    eos_token and POST /tokenize answers {"tokens": [...]}; it decodes with /detokenize."""
    async def go():
        async with serve(engine) as client:
            info = await (await client.get("/tokenizer_info")).json()
            assert info["eos_token"] == tokenizer.eos_token
            assert info["bos_token"] == tokenizer.bos_token
            r = await client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
            tokens = (await r.json())["tokens"]
            assert tokens == tokenizer.encode("test", add_special_tokens=False)
            r = await client.post("/detokenize", json={"tokens": tokens})
            assert (await r.json())["prompt"] == "test"
    run(go())


def sse_texts(tokenizer):
    from serving.openai.sse import TokenTexts
    return TokenTexts(tokenizer)


def test_completions_stream_with_usage_and_logprobs(engine, tokenizer):
    async def go():
        async with serve(engine) as client:
            r = await client.post("/v1/completions", json={
                "prompt": "hello 你好 🙂", "max_tokens": 20, "stream": True, "logprobs": 2,
                "stream_options": {"include_usage": True}})
            events = await sse_events(r)
            *chunks, last = events
            assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
            assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert text == reversed_text(tokenizer, "hello 你好 🙂", 20)
            assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
            tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
            assert len(tokens) == last["usage"]["completion_tokens"]
            lp = chunks[0]["choices"][0]["logprobs"]
            assert lp["token_logprobs"] == [-0.5] and len(lp["top_logprobs"][0]) <= 2
            assert lp["text_offset"] == [0]
    run(go())


def test_chat_stream_n2(engine, tokenizer):
    async def go():
        async with serve(engine) as client:
            r = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "the lazy dog"}],
                "n": 2, "stream": True, "max_completion_tokens": 6})
            events = await sse_events(r)
            assert all(e["object"] == "chat.completion.chunk" for e in events)
            assert len({e["id"] for e in events}) == 1
            for index in (0, 1):
                mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
                assert mine[0]["delta"] == {"role": "assistant", "content": ""}
                assert mine[-1]["finish_reason"] == "length"
                assert all(c["finish_reason"] is None for c in mine[:-1])
                text = "".join(c["delta"].get("content", "") for c in mine)
                prompt = tokenizer.apply_chat_template(
                    [{"role": "user", "content": "the lazy dog"}], tokenize=False,
                    add_generation_prompt=True)
                ids = tokenizer.encode(prompt, add_special_tokens=False)
                assert text == tokenizer.decode(ids[::-1][:6], skip_special_tokens=True)
    run(go())


def test_chat_non_stream_logprobs(engine, tokenizer):
    async def go():
        async with serve(engine) as client:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": "s"},
                             {"role": "user", "content": [{"type": "text", "text": "café"}]}],
                "logprobs": True, "top_logprobs": 3, "max_tokens": 3})
            body = await r.json()
            assert r.status == 200 and body["object"] == "chat.completion"
            choice = body["choices"][0]
            assert choice["message"]["role"] == "assistant"
            content = choice["logprobs"]["content"]
            assert len(content) == 3 == body["usage"]["completion_tokens"]
            for item in content:
                assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
                assert len(item["top_logprobs"]) == 3 and item["logprob"] == -0.5
                assert item["top_logprobs"][0]["token"] == item["token"]
                assert item["token"].startswith("bytes:") or \
                    bytes(item["bytes"]).decode() == item["token"]
    run(go())


def test_openai_client(engine, tokenizer):
    openai = pytest.importorskip("openai")

    async def go():
        async with serve(engine, api_key="sk-test") as client:
            base = str(client.make_url("/v1"))
            oc = openai.AsyncOpenAI(base_url=base, api_key="sk-test")
            stream = await oc.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello world"}],
                max_tokens=5, stream=True, stream_options={"include_usage": True})
            parts, usage = [], None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                parts += [c.delta.content or "" for c in chunk.choices]
            assert usage.completion_tokens == 5 and "".join(parts)
            done = await oc.completions.create(model=MODEL, prompt="the fox", max_tokens=3)
            assert done.choices[0].text == reversed_text(tokenizer, "the fox", 3)
            models = await oc.models.list()
            assert [m.id for m in models.data] == [MODEL]
            bad = openai.AsyncOpenAI(base_url=base, api_key="wrong")
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
            with pytest.raises(openai.NotFoundError) as info:
                await oc.completions.create(model="other", prompt="x")
            assert info.value.body["code"] == "model_not_found"
            await oc.close()
            await bad.close()
    run(go())


async def _error(r, status, param=None, code=None):
    assert r.status == status, await r.text()
    body = await r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code)
    return err


def test_error_envelopes(engine):
    async def go():
        async with serve(engine, max_body_bytes=4096) as client:
            post = client.post
            await _error(await post("/v1/completions", data=b"{nope"), 400)
            await _error(await post("/v1/completions", data=b"\xff\xfe"), 400)
            await _error(await post("/v1/completions", data=b"[1]"), 400)
            await _error(await post("/v1/completions", data=b"[" * 100000), 413)
            await _error(await post("/v1/completions", data=b"[" * 2000 + b"]" * 2000), 400)
            await _error(await post("/v1/chat/completions", json={"messages": "x"}), 400,
                         "messages")
            await _error(await post("/v1/completions", json={"prompt": "x", "n": "2"}), 400, "n")
            e = await _error(await post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                             404, "model", "model_not_found")
            assert e["type"] == "not_found_error"
            await _error(await post("/v1/completions", json={"prompt": "x" * 100}), 400,
                         "prompt", "context_length_exceeded")
            await _error(await post("/v1/completions", json={"prompt": "x", "max_tokens": 64}),
                         400, "max_tokens", "context_length_exceeded")
            await _error(await post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 60}),
                400, "max_completion_tokens", "context_length_exceeded")
            await _error(await post("/v1/completions", json={"prompt": [99999]}), 400, "prompt")
            await _error(await post("/v1/completions", json={"prompt": "", "max_tokens": 1}),
                         400, "prompt")
            await _error(await post("/v1/completions",
                                    json={"prompt": "x", "logit_bias": {"99999": 1}}),
                         400, "logit_bias")
            await _error(await client.get("/v1/nothing"), 404)
            await _error(await client.get("/v1/completions"), 405)
            await _error(await client.get("/v1/models/other"), 404, "model")
    run(go())


def test_engine_refusal_and_failures(engine):
    async def go():
        engine.max_model_len = 10 ** 6  # let max_tokens through to the engine's refusal
        async with serve(engine) as client:
            await _error(await client.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 5000}), 400)
            await _error(await client.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 5000, "stream": True}), 400)
            engine.fail_after = 2
            e = await _error(await client.post("/v1/completions", json={
                "prompt": "hello world hello", "max_tokens": 8}), 500)
            assert e["type"] == "server_error" and "device on fire" in e["message"]
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hello world"}], "stream": True,
                "max_tokens": 8})
            events = await sse_events(r)
            assert "device on fire" in events[-1]["error"]["message"]
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            engine.fail_after = None

            def boom():
                raise RuntimeError("stats exploded")
            engine.stats = boom
            e = await _error(await client.get("/metrics"), 500)
            assert e["type"] == "server_error"
            r = await client.get("/health")  # still serving
            assert r.status == 200
    run(go())


def test_auth_readiness_queue_and_health(engine):
    async def go():
        async with serve(engine, api_key="secret", max_queued_requests=2) as client:
            body = {"prompt": "hi", "max_tokens": 1}
            e = await _error(await client.post("/v1/completions", json=body), 401,
                             code="invalid_api_key")
            assert e["type"] == "authentication_error"
            await _error(await client.get("/v1/models", headers={"Authorization": "Bearer x"}),
                         401)
            await _error(await client.get("/metrics"), 401)
            auth = {"Authorization": "Bearer secret"}
            assert (await client.post("/v1/completions", json=body, headers=auth)).status == 200
            engine.ready = False
            assert (await client.get("/health")).status == 503  # no key needed
            await _error(await client.post("/v1/completions", json=body, headers=auth), 503,
                         code="not_ready")
            engine.ready = True
            assert (await client.get("/health")).status == 200
            engine.stats_.num_waiting = 2
            await _error(await client.post("/v1/chat/completions", headers=auth, json={
                "messages": [{"role": "user", "content": "x"}]}), 503, code="queue_full")
    run(go())


def test_models_tokenize_detokenize_metrics(engine, tokenizer):
    async def go():
        async with serve(engine) as client:
            models = await (await client.get("/v1/models")).json()
            assert models["object"] == "list" and models["data"][0]["id"] == MODEL
            assert models["data"][0]["object"] == "model"
            r = await (await client.post("/tokenize", json={"prompt": "hello 🙂"})).json()
            assert r == {"tokens": tokenizer.encode("hello 🙂"), "count": len(r["tokens"]),
                         "max_model_len": 64}
            msgs = [{"role": "user", "content": "hi"}]
            r = await (await client.post("/tokenize", json={"messages": msgs})).json()
            assert tokenizer.decode(r["tokens"]).startswith("<|im_start|>user\nhi")
            r = await (await client.post("/detokenize", json={"tokens": r["tokens"]})).json()
            assert r["prompt"].endswith("<|im_start|>assistant\n")
            await _error(await client.post("/detokenize", json={"tokens": [1, "a"]}), 400,
                         "tokens")
            await _error(await client.post("/tokenize", json={"prompt": 5}), 400, "prompt")

            before = await (await client.get("/metrics")).text()
            assert 'xlaserve:generation_tokens_total{model_name="tiny-test"} 0.0' in before
            await client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
            engine.stats_ = Stats(3, 1, 0.5, 4, prefix_cache_queries=120, prefix_cache_hits=96)
            r = await client.get("/metrics")
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
            for line in ['xlaserve:generation_tokens_total{model_name="tiny-test"} 2.0',
                         'xlaserve:num_requests_running{engine="0",model_name="tiny-test"} 3.0',
                         'xlaserve:num_requests_waiting{engine="0",model_name="tiny-test"} 1.0',
                         'xlaserve:kv_cache_usage_perc{engine="0",model_name="tiny-test"} 0.5',
                         'xlaserve:num_preemptions_total{engine="0",model_name="tiny-test"} 4.0',
                         'xlaserve:prefix_cache_queries_total{engine="0",model_name="tiny-test"} 120.0',
                         'xlaserve:prefix_cache_hits_total{engine="0",model_name="tiny-test"} 96.0',
                         'xlaserve:request_success_total{finished_reason="length",'
                         'model_name="tiny-test"} 1.0',
                         'xlaserve:time_to_first_token_seconds_count{model_name="tiny-test"} 1.0',
                         'xlaserve:inter_token_latency_seconds_count{model_name="tiny-test"} 1.0',
                         'xlaserve:e2e_request_latency_seconds_count{model_name="tiny-test"} 1.0',
                         'xlaserve:prompt_tokens_total{model_name="tiny-test"} ']:
                assert line in text, line
            assert "xlaserve:request_queue_time_seconds" in text
    run(go())


def test_worker_endpoints_and_vllm_metric_names(engine, tokenizer):
    """What routers call on a worker (docs/architecture.md, "Fleets"), and the series they
    read under vLLM's names."""
    async def go():
        async with serve(engine) as client:
            engine.stats_ = Stats(3, 2, 0.5, 1, prefix_cache_queries=200, prefix_cache_hits=50)
            text = await (await client.get("/metrics")).text()
            for line in ['vllm:num_requests_running{engine="0",model_name="tiny-test"} 3.0',
                         'vllm:num_requests_waiting{engine="0",model_name="tiny-test"} 2.0',
                         'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-test"} 0.5',
                         'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny-test"} 0.5',
                         'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-test"} 50.0',
                         'vllm:gpu_prefix_cache_hit_rate{engine="0",model_name="tiny-test"} 0.25',
                         'vllm:cache_config_info{block_size="16",cache_dtype="auto",'
                         'enable_prefix_caching="True",engine="0",model_name="tiny-test",'
                         'num_gpu_blocks="64"} 1.0']:
                assert line in text, line
            assert "vllm:time_to_first_token_seconds_bucket" in text

            load = await (await client.get("/get_load")).json()
            assert load == [{"dp_rank": 0, "num_reqs": 5, "num_running_reqs": 3,
                             "num_waiting_reqs": 2, "num_tokens": 512}]
            assert await (await client.get("/load")).json() == {"server_load": 5}
            info = await (await client.get("/server_info")).json()
            assert (info["served_model_name"], info["tp_size"], info["dp_size"],
                    info["page_size"]) == (MODEL, 1, 1, 16)
            model_info = await (await client.get("/get_model_info")).json()
            assert model_info["is_generation"] and model_info["model_path"] == "fake-model-dir"

            msgs = [{"role": "user", "content": "hello there"}]
            rendered = await (await client.post("/v1/chat/completions/render",
                                                json={"model": MODEL, "messages": msgs})).json()
            expected = await (await client.post("/tokenize", json={"messages": msgs})).json()
            assert rendered["token_ids"] == expected["tokens"] and rendered["model"] == MODEL
            rendered = await (await client.post("/v1/completions/render", json={
                "prompt": ["hello", "5 6"]})).json()
            assert [r["token_ids"] for r in rendered] == [tokenizer.encode("hello"), tokenizer.encode("5 6")]
            rendered = await (await client.post("/v1/completions/render", json={
                "prompt": [5, 6, 7]})).json()
            assert [r["token_ids"] for r in rendered] == [[5, 6, 7]]
            await _error(await client.post("/v1/chat/completions/render", json={
                "messages": msgs, "model": "nope"}), 404, "model")
            await _error(await client.post("/v1/completions/render", json={
                "prompt": [10 ** 9]}), 400, "prompt")

            r = await client.post("/reset_prefix_cache")
            assert r.status == 200
            assert (await client.post("/flush_cache")).status == 200
            engine.reset_ok = False  # requests running: nothing is reset, and the caller knows
            await _error(await client.post("/flush_cache"), 400, code="requests_running")
            await _error(await client.post("/reset_prefix_cache"), 400, code="requests_running")
    run(go())


def test_tokenizer_endpoints_without_a_tokenizer_are_a_400(engine):
    async def go():
        async with serve(engine) as client:
            engine.tokenizer = None  # served with token ids in and out
            await _error(await client.post("/detokenize", json={"tokens": [5]}), 400,
                         code="no_tokenizer")
            await _error(await client.post("/tokenize", json={"prompt": "hi"}), 400,
                         code="no_tokenizer")
            await _error(await client.get("/tokenizer_info"), 400, code="no_tokenizer")
    run(go())


def test_stream_disconnect_aborts(engine):
    async def go():
        engine.block_after = 3
        async with serve(engine) as client:
            r = await client.post("/v1/completions", json={
                "prompt": "hello world the quick brown fox", "max_tokens": 20, "stream": True})
            first = await r.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            r.close()  # the client goes away mid-stream
            await asyncio.wait_for(engine.aborted_event.wait(), 5)
            assert engine.aborted == [engine.requests[0][0]]
    run(go())


def test_non_stream_disconnect_aborts_all_choices(engine):
    async def go():
        engine.block_after = 1
        async with serve(engine) as client:
            task = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": ["hello world", "the fox"], "max_tokens": 5, "n": 3}))
            while len(engine.requests) < 2:  # one engine request (of 3 samples) per prompt
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection
            for _ in range(500):
                if len(engine.aborted) == 2:
                    break
                await asyncio.sleep(0.01)
            assert sorted(engine.aborted) == sorted(rid for rid, _, _ in engine.requests)
    run(go())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_server_drains_then_aborts_after_grace(engine, capsys):
    async def go():
        port = _free_port()
        stop = asyncio.Event()
        engine.block_after = 2
        server = asyncio.create_task(run_server(engine, "127.0.0.1", port,
                                                served_model_name=MODEL, grace_period_s=0.5,
                                                stop_event=stop))
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            await _wait_healthy(session, url)
            resp = await session.post(url + "/v1/completions", json={
                "prompt": "hello world the fox", "max_tokens": 9, "stream": True})
            await resp.content.readuntil(b"\n\n")
            stop.set()
            await asyncio.wait_for(server, 10)  # grace expired: the blocked request aborted
            assert engine.aborted
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.get(url + "/health")
        assert f"127.0.0.1:{port}" in capsys.readouterr().out
    run(go())


def test_sigterm_lets_in_flight_requests_finish(engine, tokenizer):
    async def go():
        port = _free_port()
        entered, gate = asyncio.Event(), asyncio.Event()
        engine.hold = (entered, gate)  # hold the request until SIGTERM has been delivered
        server = asyncio.create_task(run_server(engine, "127.0.0.1", port,
                                                served_model_name=MODEL, grace_period_s=10))
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            await _wait_healthy(session, url)
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # ours, not default
            pending = asyncio.create_task(session.post(url + "/v1/completions", json={
                "prompt": "hello world", "max_tokens": 4}))
            await asyncio.wait_for(entered.wait(), 5)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.1)
            assert not server.done()  # draining, not gone
            async with aiohttp.ClientSession() as other:  # a new connection: not accepted
                with pytest.raises(aiohttp.ClientConnectionError):
                    await other.get(url + "/health")
            gate.set()
            resp = await pending
            assert resp.status == 200
            body = await resp.json()
            assert body["choices"][0]["text"] == reversed_text(tokenizer, "hello world", 4)
            await asyncio.wait_for(server, 10)
            assert engine.aborted == []
    run(go())


async def _wait_healthy(session, url):
    for _ in range(250):
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.02)
    raise AssertionError("server did not come up")


def test_token_texts(tokenizer):
    from serving.openai.token_texts import TokenTexts
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("héllo 你好 🙂", add_special_tokens=False)
    raw = b"".join(bytes(texts.get(i)[1]) for i in ids)
    assert raw.decode() == "héllo 你好 🙂"
    partial = [texts.get(i)[0] for i in ids if texts.get(i)[0].startswith("bytes:")]
    assert partial and all("\\x" in t for t in partial)  # split characters, OpenAI style
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert texts.get(special) == ("<|im_end|>", list(b"<|im_end|>"))


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_without_handler_cancellation(engine, stream):
    # Another runner than ours may not cancel handlers when a client goes away; the
    # server must still notice while the engine produces nothing.
    async def go():
        engine.block_after = 1
        runner = aiohttp.web.AppRunner(build_app(engine, served_model_name=MODEL),
                                       handler_cancellation=False)
        await runner.setup()
        port = _free_port()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(session.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"prompt": "hello world", "max_tokens": 5, "stream": stream}))
                while not engine.requests:
                    await asyncio.sleep(0.01)
                if stream:
                    resp = await task
                    await resp.content.readuntil(b"\n\n")
                    resp.close()
                else:
                    task.cancel()
                await asyncio.wait_for(engine.aborted_event.wait(), 5)
                assert engine.aborted == [engine.requests[0][0]]
        finally:
            await runner.cleanup()
    run(go())
