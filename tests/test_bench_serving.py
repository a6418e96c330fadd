"""scripts/bench_serving.py: the metric math on synthetic timestamps, the arrival process, the
datasets, and one run against an in-process fake OpenAI streaming server (no model)."""
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", _PATH)
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bs  # dataclasses look their module up there
_spec.loader.exec_module(bs)


# -- metric math ---------------------------------------------------------------------------------

def test_chunk_timing_gives_ttft_itl_and_e2el():
    ttft, itl, e2el = bs.chunk_timing(10.0, [10.25, 10.5, 10.75, 11.5])
    assert ttft == pytest.approx(0.25)
    assert itl == pytest.approx([0.25, 0.25, 0.75])
    assert e2el == pytest.approx(1.5)


def test_single_chunk_has_no_itl():
    ttft, itl, e2el = bs.chunk_timing(0.0, [0.3])
    assert (ttft, itl, e2el) == (pytest.approx(0.3), [], pytest.approx(0.3))


def test_tpot_excludes_the_first_token():
    # 1 s to the first token, then 9 more tokens over 0.9 s: 100 ms each.
    assert bs.tpot(latency=1.9, ttft=1.0, output_tokens=10) == pytest.approx(0.1)
    assert bs.tpot(latency=1.0, ttft=1.0, output_tokens=1) is None
    assert bs.tpot(latency=1.0, ttft=1.0, output_tokens=0) is None


def _out(ttft, latency, tokens, itl, prompt_len=5, success=True):
    return bs.RequestOutput(success=success, prompt_len=prompt_len, output_tokens=tokens,
                            ttft=ttft, latency=latency, itl=itl)


def test_summarize_counts_throughputs_and_percentiles():
    outputs = [
        _out(0.1, 1.1, 11, [0.1] * 10),           # tpot 100 ms
        _out(0.3, 0.7, 3, [0.2, 0.2]),            # tpot 200 ms
        _out(0.2, 0.2, 1, []),                    # one token: no tpot sample
        _out(0, 0, 0, [], prompt_len=7, success=False),
    ]
    r = bs.summarize(outputs, duration=2.0, percentiles=(50, 99))
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 15 and r["total_output_tokens"] == 15
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(7.5)
    assert r["total_token_throughput"] == pytest.approx(15.0)
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(150.0)  # two samples, the 1-token request has none
    assert r["p50_tpot_ms"] == pytest.approx(150.0)
    itl = [100.0] * 10 + [200.0] * 2
    assert r["mean_itl_ms"] == pytest.approx(np.mean(itl))
    assert r["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99))
    assert r["median_itl_ms"] == pytest.approx(100.0)
    report = bs.format_report(r | {"max_concurrency": 4}, percentiles=(50, 99))
    assert "Successful requests:" in report and "P99 ITL (ms):" in report
    assert "Maximum request concurrency:" in report


def test_summarize_with_no_success_reports_zeros_not_nan():
    r = bs.summarize([_out(0, 0, 0, [], success=False)], duration=1.0)
    assert r["completed"] == 0 and r["mean_ttft_ms"] == 0.0 and r["p99_tpot_ms"] == 0.0


# -- arrivals ------------------------------------------------------------------------------------

def test_poisson_gaps_have_the_requested_mean_rate_and_unit_cv():
    gaps = bs.arrival_gaps(20000, rate=4.0, burstiness=1.0, rng=np.random.default_rng(1))
    assert 1.0 / gaps.mean() == pytest.approx(4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


def test_burstiness_sets_the_gamma_shape():
    gaps = bs.arrival_gaps(20000, rate=2.0, burstiness=4.0, rng=np.random.default_rng(2))
    assert 1.0 / gaps.mean() == pytest.approx(2.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.05)  # CV = 1/sqrt(shape)


def test_arrival_times_are_seeded_increasing_and_end_at_n_over_rate():
    t = bs.arrival_times(50, rate=10.0, seed=3)
    assert np.all(np.diff(t) >= 0) and t[-1] == pytest.approx(5.0)
    assert np.array_equal(t, bs.arrival_times(50, rate=10.0, seed=3))
    assert not np.array_equal(t, bs.arrival_times(50, rate=10.0, seed=4))
    assert np.array_equal(bs.arrival_times(5, rate=float("inf")), np.zeros(5))


# -- datasets ------------------------------------------------------------------------------------

def test_datasets_are_seeded_with_the_requested_lengths():
    a = bs.random_dataset(4, 12, 7, seed=0)
    assert a == bs.random_dataset(4, 12, 7, seed=0)
    assert a != bs.random_dataset(4, 12, 7, seed=1)
    assert all(len(r.prompt.split()) == 12 and r.prompt_len == 12 and r.output_len == 7 for r in a)
    chat = bs.synthetic_chat_dataset(200, 100, 50, seed=0, max_model_len=512)
    ins, outs = np.array([r.prompt_len for r in chat]), np.array([r.output_len for r in chat])
    assert np.all(ins + outs <= 512) and ins.min() >= 4 and outs.min() >= 1
    assert len(set(ins)) > 50 and 60 < np.median(ins) < 160  # spread around the median


def test_token_prompts_retokenize_to_the_requested_length(demo_model_dir):
    tok = bs.load_tokenizer(str(demo_model_dir))
    for r in bs.random_dataset(3, 130, 8, seed=0, tokenizer=tok):
        assert r.prompt_len == 130
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == 130


def test_request_body_uses_the_endpoint_shape():
    req = bs.SampleRequest("hi there", 2, 16)
    c = bs.request_body("/v1/completions", "m", req, ignore_eos=True, temperature=0.0)
    assert c["prompt"] == "hi there" and c["max_tokens"] == 16 and c["ignore_eos"] is True
    assert c["stream"] is True and c["stream_options"] == {"include_usage": True}
    chat = bs.request_body("/v1/chat/completions", "m", req, ignore_eos=False, temperature=0.5)
    assert chat["messages"] == [{"role": "user", "content": "hi there"}] and "ignore_eos" not in chat


# -- against a fake server -----------------------------------------------------------------------

def _fake_app(usage: bool) -> web.Application:
    """Streams max_tokens one-token chunks (two tokens in the third chunk, so the chunk count and
    the usage count differ), then a usage chunk when asked; prompts starting "FAIL" get a 500."""

    async def completions(request):
        body = await request.json()
        if body["prompt"].startswith("FAIL"):
            return web.json_response({"error": {"message": "boom"}}, status=500)
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": ping\n\n")
        n, sent, i = body["max_tokens"], 0, 0
        while sent < n:
            k = 2 if (i == 2 and n - sent >= 2) else 1
            text = "tok " * k
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(0.002)
            sent, i = sent + k, i + 1
        if usage and body.get("stream_options", {}).get("include_usage"):
            u = {"prompt_tokens": 3, "completion_tokens": sent, "total_tokens": 3 + sent}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': u})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _run_against_fake(usage: bool, requests, **kwargs):
    runner = web.AppRunner(_fake_app(usage))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await bs.run_benchmark(f"http://127.0.0.1:{port}", "/v1/completions", "fake",
                                      requests, quiet=True, **kwargs)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("usage", [True, False])
def test_report_counts_against_a_fake_streaming_server(usage):
    requests = [bs.SampleRequest(f"prompt {i}", 2, 6) for i in range(7)]
    requests += [bs.SampleRequest("FAIL now", 2, 6)]
    r = asyncio.run(_run_against_fake(usage, requests, max_concurrency=3, request_rate=200.0))
    assert (r["completed"], r["failed"]) == (7, 1)
    assert r["errors"] and r["errors"][0].startswith("HTTP 500")
    # With usage the server's 6 tokens count; without, each of the 5 text chunks counts as one.
    per_request = 6 if usage else 5
    assert r["total_output_tokens"] == 7 * per_request
    assert r["total_input_tokens"] == 7 * (3 if usage else 2)
    assert len(r["itls"][0]) == 4  # 5 content chunks: 4 gaps (the usage chunk is not one)
    assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])


def test_sweep_writes_results_and_a_plot(tmp_path):
    """The command line end to end: a concurrency sweep against the fake server in a thread."""
    import threading

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_fake_app(usage=True))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
        rc = bs.main(["--base-url", f"http://127.0.0.1:{port}", "--model", "fake",
                      "--num-prompts", "6", "--input-len", "4", "--output-len", "5",
                      "--sweep", "1,3", "--save-result", str(out), "--plot", str(plot)])
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert rc == 0
    results = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in results] == [1, 3]
    assert all(r["completed"] == 6 and r["total_output_tokens"] == 30 for r in results)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_side_by_side_rewrites_only_its_section(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_side_by_side",
                                                  _PATH.parent / "bench_side_by_side.py")
    sbs = importlib.util.module_from_spec(spec)
    sys.modules["bench_side_by_side"] = sbs
    spec.loader.exec_module(sbs)
    r = {"server": "ours", "sweep_value": 16, "num_prompts": 16, "output_throughput": 200.0,
         "median_ttft_ms": 500.0, "median_tpot_ms": 20.0, "p99_itl_ms": 40.0, "failed": 0,
         "startup_s": 3.0, "round": 0}
    meta = {"date": "d", "machine": "m", "commit": "c", "workload": "w", "load_end": 1.0,
            "commands": {"ours": "x", "llama.cpp": "y"}}
    results = [r, r | {"server": "llama.cpp", "output_throughput": 100.0, "median_ttft_ms": 1000.0,
                       "median_tpot_ms": 10.0}]
    doc = tmp_path / "benchmarks.md"
    sbs.update_doc(doc, sbs.render_section(results, meta))
    doc.write_text(doc.read_text() + "\nnotes the lead keeps\n")
    sbs.update_doc(doc, sbs.render_section(results, meta))
    text = doc.read_text()
    assert text.count(sbs.BEGIN) == 1 and "notes the lead keeps" in text
    assert "| 16 | 2.00 [>= 3] | 0.50 | 2.00 |" in text  # ours / llama.cpp ratios
    assert "one round" in text


def test_side_by_side_rounds_pair_each_level(tmp_path):
    """With several rounds the table shows each metric's median over the rounds, and a ratio is
    the median of the rounds' ratios: the machine slowing down between rounds cancels out."""
    spec = importlib.util.spec_from_file_location("bench_side_by_side",
                                                  _PATH.parent / "bench_side_by_side.py")
    sbs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sbs)
    base = {"sweep_value": 64, "num_prompts": 64, "median_ttft_ms": 100.0, "median_tpot_ms": 10.0,
            "p99_itl_ms": 20.0, "failed": 0, "startup_s": 1.0}
    tok_s = [(200.0, 100.0), (300.0, 100.0), (240.0, 120.0)]  # (ours, llama.cpp) per round
    runs = [base | {"server": s, "round": i, "output_throughput": v, "failed": int(s == "ours")}
            for i, pair in enumerate(tok_s) for s, v in zip(("ours", "llama.cpp"), pair)]
    rows = {r["server"]: r for r in sbs.summarize(runs)}
    assert rows["ours"]["output_throughput"] == 240.0 and rows["ours"]["rounds"] == 3
    assert rows["llama.cpp"]["output_throughput"] == 100.0
    assert rows["ours"]["failed"] == 3 and rows["llama.cpp"]["failed"] == 0
    assert sbs.paired_ratios(runs, 64, "output_throughput") == [2.0, 3.0, 2.0]
    meta = {"date": "d", "machine": "m", "commit": "c", "workload": "w", "load_end": 1.0,
            "commands": {"ours": "x", "llama.cpp": "y"}}
    text = sbs.render_section(runs, meta)
    # 2.00, not 240 / 100: each round's ratio first, then their median
    assert "| 64 | 2.00 (2.00-3.00) [>= 4] | 1.00 (1.00-1.00) | 1.00 (1.00-1.00) |" in text
    assert "| 64 | 64 | ours | 240.0 |" in text and "3 rounds" in text


# -- chat-like datasets (scripts/bench_conversations.py) ---------------------------------------

sys.path.insert(0, str(_PATH.parent))
import bench_conversations as bc  # noqa: E402


def test_shared_prefix_datasets_are_seeded_and_share_their_prefixes():
    convs = bc.multi_turn_dataset(3, 4, system_len=50, user_len=5, output_len=7, seed=1)
    assert len({c.system for c in convs}) == 1 and len(convs[0].system.split()) == 50
    assert all(len(c.user_turns) == 4 and c.output_len == 7 for c in convs)
    assert len({t for c in convs for t in c.user_turns}) == 12
    assert bc.multi_turn_dataset(3, 4, 50, 5, 7, seed=1) == convs
    shots = bc.few_shot_dataset(12, num_tasks=2, num_examples=3, example_len=6,
                                question_len=4, output_len=5, seed=2)
    preambles = {s.prompt.rsplit("\nQ: ", 1)[0] for s in shots}
    assert len(preambles) == 2 and all(p.count("Example") == 3 for p in preambles)
    assert len({s.prompt for s in shots}) == 12 and all(s.output_len == 5 for s in shots)


def test_conversations_resend_their_history_with_the_replies():
    seen = []

    async def chat(request):
        body = await request.json()
        seen.append(body["messages"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        reply = f"reply{len(body['messages'])}"
        choice = {"index": 0, "delta": {"content": reply}}
        await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            convs = bc.multi_turn_dataset(2, 3, 10, 3, 4, seed=0)
            return convs, await bc.run_conversations(f"http://127.0.0.1:{port}", "fake", convs,
                                                     max_concurrency=2, quiet=True)
        finally:
            await runner.cleanup()

    convs, r = asyncio.run(go())
    assert (r["completed"], r["failed"], r["num_conversations"]) == (6, 0, 2)
    assert r["median_ttft_first_turn_ms"] > 0 and r["median_ttft_later_turns_ms"] > 0
    last = max(seen, key=len)
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant",
                                         "user"]
    assert last[2]["content"] == "reply2" and last[4]["content"] == "reply4"
    assert any(last[1]["content"] == c.user_turns[0] for c in convs)
