"""The real server with the real engine on the demo model (SmolLM2-135M-Instruct, float32),
on a loopback port, driven by the official `openai` client and raw HTTP.

One engine serves the whole module (warm-up compiles two programs, fast with the persistent
compilation cache). Next to the main server, the same event loop serves three more apps over
the same engine: one behind an API key, one with a queue limit, and one whose engine is not
started (warming up). Greedy decoding everywhere a test compares texts.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import openai
import pytest

from tests.server_util import (API_KEY, MAX_QUEUED, MODEL, assert_error, get_json,
                               live_server, metric, metrics, open_stream, post, request, stream,
                               wait_until)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(demo_checkpoint):
    with live_server(demo_checkpoint) as server:
        yield server


def _chat_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])


# -- basics ----------------------------------------------------------------------------------

def test_health_and_models(live):
    assert get_json(live.port, "/health") == (200, {"status": "ok"})
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, card = get_json(live.port, f"/v1/models/{MODEL}")
    assert status == 200 and card["id"] == MODEL and card["max_model_len"] == 256


def test_chat_capital_of_france(live):
    client = live.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=32)
    choice = resp.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert resp.object == "chat.completion" and resp.model == MODEL
    ids = post(live.port, "/tokenize", {"messages": messages})[1]["tokens"]
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    # The same, streamed through the openai client, with the usage chunk.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump() == resp.usage.model_dump()
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["stop"]


def test_chat_stream_raw_sse_with_usage(live):
    """The exact wire format: role first, finish_reason last, usage chunk, [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": [
                                             {"type": "text", "text": "Say hello."}]}],
            "temperature": 0, "max_tokens": 6, "stream_options": {"include_usage": True}}
    events = stream(live.port, "/v1/chat/completions", body)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks)  # present and null, as OpenAI sends them
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    del body["stream_options"]  # only allowed with stream: true
    non_stream = post(live.port, "/v1/chat/completions", body)[1]
    assert _chat_text(chunks) == non_stream["choices"][0]["message"]["content"]
    assert usage["usage"] == non_stream["usage"]


def test_completions_stream_and_not(live):
    client = live.client()
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    resp = client.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 6
    assert choice.text.strip()
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"

    # Token-id prompts, two of them in one request, and echo.
    ids = live.tokenizer.encode("The capital of France is")
    resp2 = client.completions.create(**{**kwargs, "prompt": [ids, ids]})
    assert [c.text for c in resp2.choices] == [choice.text] * 2
    assert resp2.usage.prompt_tokens == 2 * len(ids)
    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + choice.text


def test_n_greater_than_one(live):
    client = live.client()
    kwargs = dict(model=MODEL, prompt="My favourite colour is", max_tokens=4, n=3,
                  temperature=1.0, seed=123, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert first.usage.completion_tokens == 12
    again = client.completions.create(**kwargs)  # seeded: reproducible choice by choice
    assert [c.text for c in again.choices] == [c.text for c in first.choices]

    events = stream(live.port, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "n": 2,
        "temperature": 0, "max_tokens": 5})
    by_index = {0: [], 1: []}
    for e in events:
        (c,) = e["choices"]
        by_index[c["index"]].append(c)
    for chunks in by_index.values():
        assert chunks[0]["delta"]["role"] == "assistant"
        assert chunks[-1]["finish_reason"] in ("stop", "length")
    texts = ["".join(c["delta"].get("content", "") for c in chunks)
             for chunks in by_index.values()]
    assert texts[0] == texts[1]  # greedy: both choices agree


def test_stop_strings(live):
    client = live.client()
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]  # stops inside the completion, never at its very start
    want = full[:full.index(stop)]
    resp = client.completions.create(**kwargs, stop=[stop, "never-appears"])
    choice = resp.choices[0]
    assert choice.text == want and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want  # no part of the stop leaks
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(live):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
            "temperature": 0, "logprobs": 3, "ignore_eos": True}
    status, resp = post(live.port, "/v1/completions", body)
    assert status == 200
    choice = resp["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy took the best
        assert top.get(tok, value) == pytest.approx(value, abs=1e-4)

    events = stream(live.port, "/v1/completions", body)
    streamed = [t for e in events for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert streamed == lp["tokens"]


def test_chat_logprobs(live):
    client = live.client()
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=5,
        logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 2 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=5,
        logprobs=True, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_multibyte_characters_never_split(live):
    """The demo model answers with emoji, each spread over several byte-level tokens: no
    delta may carry half a character (U+FFFD), logprobs show the pieces as bytes."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Reply with three emojis."}],
            "max_tokens": 6, "temperature": 0, "logprobs": True}
    events = stream(live.port, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events]
    tokens = [t for e in events if e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["content"]]
    assert any(t["token"].startswith("bytes:") for t in tokens), tokens  # split characters
    assert not any("\ufffd" in d for d in deltas), deltas
    text = "".join(deltas)
    assert any(ord(c) > 0xFFFF for c in text), text
    assert bytes(b for t in tokens for b in t["bytes"]).decode() == text
    assert post(live.port, "/v1/chat/completions", body)[1]["choices"][0]["message"][
        "content"] == text


# -- batching --------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn is",
           "My favourite food is", "Water boils at", "The sun rises in the",
           "A good friend is someone who", "In the year 2050,"]


def test_32_concurrent_streams_match_one_by_one(live):
    """Each of 8 prompts 4 times (32 streams at once, the engine's max_num_seqs), against the
    same prompts sent one at a time."""
    client = live.client()
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0)
    alone = {p: client.completions.create(prompt=p, **kwargs).choices[0] for p in PROMPTS}

    async def one(aclient, prompt):
        text, finish = "", None
        async for chunk in await aclient.completions.create(prompt=prompt, stream=True,
                                                            **kwargs):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return prompt, text, finish

    peak = 0
    done = threading.Event()

    def watch():  # confirms the streams really ran in one batch
        nonlocal peak
        while not done.is_set():
            peak = max(peak, metric(metrics(live.port), "xlaserve:num_requests_running"))
            time.sleep(0.05)

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS * 4))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(all_at_once())
    finally:
        done.set()
        watcher.join()
    assert len(results) == 32
    for prompt, text, finish in results:
        assert (text, finish) == (alone[prompt].text, alone[prompt].finish_reason), prompt
    assert peak > 8, peak  # more requests at once than the small request bucket holds
    live.wait_idle()


# -- disconnects and admission -------------------------------------------------------------

def test_stream_disconnect_frees_pages(live):
    before = metrics(live.port)
    sock, _ = open_stream(live.port, "/v1/completions", {
        "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 200,
        "ignore_eos": True}, num_events=3)
    assert live.used_pages() > 0
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    live.wait_idle()
    after = metrics(live.port)
    key = "xlaserve:request_success_total"
    assert metric(after, key, finished_reason="abort") == \
        metric(before, key, finished_reason="abort") + 1
    assert metric(after, key, finished_reason="length") == \
        metric(before, key, finished_reason="length")


def test_non_stream_disconnect_frees_pages(live):
    payload = json.dumps({"model": MODEL, "prompt": "Count to a thousand:", "n": 2,
                          "max_tokens": 200, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", live.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    wait_until(lambda: metric(metrics(live.port), "xlaserve:num_requests_running") == 2, 60,
               "both choices to run")
    sock.close()
    live.wait_idle()


def test_queue_full_then_admits_again(live):
    """Fill max_num_seqs with long streams so requests wait; the queue-limited app then
    answers 503 queue_full, and admits again once they are gone."""
    status, body = post(live.queue_port, "/v1/completions",
                        {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 200, body  # not full: admitted
    socks = []
    try:
        for i in range(32 + MAX_QUEUED + 1):
            payload = json.dumps({"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 200,
                                  "ignore_eos": True, "stream": True}).encode()
            s = socket.create_connection(("127.0.0.1", live.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
            socks.append(s)
        wait_until(lambda: metric(metrics(live.port), "xlaserve:num_requests_waiting")
                   >= MAX_QUEUED, 60, "requests to queue")
        status, body = post(live.queue_port, "/v1/completions",
                            {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert_error(status, body, 503, code="queue_full", type_="service_unavailable_error")
        with pytest.raises(openai.APIStatusError) as info:
            openai.OpenAI(base_url=f"http://127.0.0.1:{live.queue_port}/v1", api_key="x",
                          max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        assert info.value.status_code == 503
    finally:
        for s in socks:
            s.close()
    live.wait_idle()
    status, body = post(live.queue_port, "/v1/completions",
                        {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 200, body


# -- errors ----------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Hi"}

BAD_REQUESTS = [  # (path, body, param, code)
    ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt", None),
    ("/v1/completions", {**COMPLETION, "max_tokens": "5"}, "max_tokens", None),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature", None),
    ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream", None),
    ("/v1/completions", {**COMPLETION, "stop": [1]}, "stop", None),
    ("/v1/completions", {"model": MODEL}, "prompt", None),
    ("/v1/chat/completions", {**CHAT, "messages": "Hi"}, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
     "messages", None),
    ("/v1/chat/completions", {**CHAT, "n": 1.5}, "n", None),
    # out of range
    ("/v1/completions", {**COMPLETION, "temperature": 1000}, "temperature", None),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p", None),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs",
     None),
    ("/v1/completions", {**COMPLETION, "prompt": [49152]}, "prompt", None),  # past the vocab
    ("/v1/completions", {**COMPLETION, "logit_bias": {"99999999": 1}}, "logit_bias", None),
    # context length
    ("/v1/completions", {**COMPLETION, "prompt": [1] * 300}, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {**COMPLETION, "prompt": "word " * 300}, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 1000}, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 1000}, "max_completion_tokens",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("path,body,param,code", BAD_REQUESTS)
def test_bad_request_400(live, path, body, param, code):
    status, resp = post(live.port, path, body)
    assert_error(status, resp, 400, param=param, code=code, type_="invalid_request_error")


def test_malformed_json_400(live):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        status, resp = post(live.port, "/v1/completions", raw,
                            {"Content-Type": "application/json"})
        assert_error(status, resp, 400, type_="invalid_request_error")


def test_openai_client_errors(live):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"


def test_unknown_model_and_route_404(live):
    for path, body in (("/v1/completions", {**COMPLETION, "model": "gpt-4"}),
                       ("/v1/chat/completions", {**CHAT, "model": "gpt-4"})):
        status, resp = post(live.port, path, body)
        assert_error(status, resp, 404, param="model", code="model_not_found",
                      type_="not_found_error")
    status, resp = get_json(live.port, "/v1/models/gpt-4")
    assert_error(status, resp, 404, param="model", code="model_not_found")
    status, resp = get_json(live.port, "/v1/nothing-here")
    assert_error(status, resp, 404, code="not_found")


def test_oversized_body_413(live):
    big = json.dumps({**COMPLETION, "prompt": "x" * (5 << 20)}).encode()
    status, resp = post(live.port, "/v1/completions", big)
    assert_error(status, resp, 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]
    status, _, raw = request(live.port, "POST", "/v1/completions", chunks(),
                             {"Content-Type": "application/json"})  # http.client chunks it
    assert_error(status, json.loads(raw), 413, code="request_too_large")


def test_api_key_401(live):
    port = live.auth_port
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        status, resp = post(port, "/v1/completions", COMPLETION, headers)
        assert_error(status, resp, 401, code="invalid_api_key", type_="authentication_error")
    assert get_json(port, "/v1/models")[0] == 401
    assert get_json(port, "/health")[0] == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong",
                      max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens


def test_not_ready_503(live):
    port = live.cold_port
    status, resp = get_json(port, "/health")
    assert_error(status, resp, 503, code="not_ready", type_="service_unavailable_error")
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        status, resp = post(port, path, body)
        assert_error(status, resp, 503, code="not_ready")


def test_errors_leave_nothing_behind(live):
    live.wait_idle()
    assert get_json(live.port, "/health")[0] == 200


# -- metrics, tokenizer routes -------------------------------------------------------------

def test_metrics_move_after_traffic(live):
    live.wait_idle()
    before = metrics(live.port)
    n_prompt = post(live.port, "/tokenize", {"prompt": "Water boils at"})[1]["count"]
    status, _ = post(live.port, "/v1/completions", {
        "model": MODEL, "prompt": "Water boils at", "max_tokens": 5, "ignore_eos": True})
    assert status == 200
    after = metrics(live.port)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("xlaserve:prompt_tokens_total") == n_prompt
    assert delta("xlaserve:generation_tokens_total") == 5
    assert delta("xlaserve:request_success_total", finished_reason="length") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"xlaserve:{hist}_count") == 1, hist
        assert delta(f"xlaserve:{hist}_sum") >= 0
    assert delta("xlaserve:inter_token_latency_seconds_count") >= 1
    assert delta("xlaserve:time_to_first_token_seconds_sum") > 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"xlaserve:{gauge}", ()) in after
    assert ("xlaserve:num_preemptions_total", ()) in after


def test_tokenize_detokenize(live):
    status, body = post(live.port, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200
    assert body["tokens"] == live.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert post(live.port, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}) == \
        (200, {"prompt": "Hello world"})
    status, chat = post(live.port, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    text = live.tokenizer.decode(chat["tokens"])
    assert status == 200 and "Hi" in text and text.rstrip().endswith("assistant")
    status, resp = post(live.port, "/detokenize", {"tokens": [10 ** 9]})
    assert_error(status, resp, 400, param="tokens")
    status, resp = post(live.port, "/tokenize", {"prompt": 5})
    assert_error(status, resp, 400, param="prompt")
