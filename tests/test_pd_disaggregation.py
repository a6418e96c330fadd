"""Prefill/decode disaggregation (docs/architecture.md, "Prefill/decode disaggregation"):
the config, the scheduler's side (no JAX), gather/scatter on a small KV cache, and two
`xlaserve serve` processes on 127.0.0.1 driven through vLLM's `kv_transfer_params`
handshake as a P/D proxy drives them (prefill with max_tokens 1, then the original request
to the decode instance with the prefill's answer)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving.core.request import Request, RequestStatus
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig
from serving.kv_transfer.config import KVTransferConfig
from serving.kv_transfer.params import Offer
from tests.server_util import free_port, metric, metrics, post, wait_healthy, wait_until

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
# The e2e tests' sizes; buckets are the defaults these give (compiled programs on disk).
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "32", "--max-num-batched-tokens", "64"]
OFFER_TIMEOUT_S = 2
PROMPT = ("The history of the Roman empire begins with the founding of the city, and "
          "its long story runs through kings, a republic and emperors, until ")


# -- config ------------------------------------------------------------------------------------

def test_config_takes_vllm_keys():
    c = KVTransferConfig.parse('{"kv_connector": "JaxTransferConnector", "kv_role": '
                               '"kv_consumer", "kv_port": 0, "kv_buffer_size": 1e9, '
                               '"kv_connector_extra_config": {"pull_timeout_s": 5}}')
    assert (c.kv_role, c.is_consumer, c.is_producer, c.extra("pull_timeout_s"),
            c.extra("offer_timeout_s")) == ("kv_consumer", True, False, 5, 120.0)
    assert KVTransferConfig.parse({"kv_port": 9000}).side_channel_port == 9001
    assert KVTransferConfig.parse(None) is None and KVTransferConfig.parse("") is None


@pytest.mark.parametrize("value, message", [
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "JaxTransferConnector"),
    ('{"kv_role": "kv_prefill"}', "kv_role"),
    ('{"kv_rol": "kv_both"}', "unknown key"),
    ('{"kv_port": "80"}', "kv_port"),
    ('{"kv_connector_extra_config": {"timeout": 1}}', "unknown kv_connector_extra_config"),
    ('{"kv_connector_extra_config": {"offer_timeout_s": 0}}', "offer_timeout_s"),
    ("[1]", "JSON object"),
    ("{", "not valid JSON"),
])
def test_config_refusals_name_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(value)


def test_offer_round_trips_through_the_answer():
    offer = Offer(2**49 + 3, "10.0.0.1", 9000, 9001, 2, 32, "ab", [["k", [30, 16, 3, 64],
                                                                    "float16"]])
    params = offer.answer("req-1", "engine-a", [5, 9])
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [5, 9] and params["remote_request_id"] == "req-1"
    assert Offer.from_params(params) == offer
    with pytest.raises(ValueError, match="transfer_id"):
        Offer.from_params({**params, "transfer_id": None})


# -- the scheduler: a request waiting for its KV -------------------------------------------------

def _scheduler(num_pages=9) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                     max_model_len=64, page_size=4, num_pages=num_pages))


def _request(rid: str, n: int, remote: int = 0) -> Request:
    req = Request(rid, list(range(100 * len(rid), 100 * len(rid) + n)),
                  SamplingParams(max_tokens=4))
    req.remote_tokens = remote
    return req


def test_a_loading_request_holds_pages_and_blocks_nobody():
    sched = _scheduler()
    remote, local = _request("r", 10, remote=8), _request("l", 5)
    sched.add_request(remote)
    sched.add_request(local)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [local]  # not the one loading
    assert sched.take_loads() == [remote] and sched.take_loads() == []
    assert len(sched.page_ids("r")) == 2 and sched.num_waiting == 1
    sched.finish_load(remote, loaded=True)
    sched.update(out, [7])
    out = sched.schedule()
    assert {(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled} == {
        ("r", 8, 2), ("l", 5, 1)}  # only the tail after the loaded pages
    assert sched.num_prompt_tokens_total == 5


def test_a_failed_load_prefills_the_whole_prompt():
    sched = _scheduler()
    req = _request("r", 10, remote=8)
    sched.add_request(req)
    sched.schedule()
    sched.finish_load(req, loaded=False)
    assert sched.allocator.num_used_pages == 0
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 10)]


def test_abort_while_loading_frees_everything():
    sched = _scheduler()
    req = _request("r", 10, remote=8)
    sched.add_request(req)
    sched.schedule()
    sched.abort("r")
    assert sched.allocator.num_used_pages == 0 and not sched.loading
    assert req.status is RequestStatus.FINISHED_ABORTED
    sched.finish_load(req, loaded=True)  # the pull lands after the abort: ignored
    assert not sched.has_unfinished and sched.allocator.num_used_pages == 0


def test_a_load_waits_for_pages():
    sched = _scheduler(num_pages=5)  # four usable pages
    sched.add_request(_request("a", 10))  # three of them
    sched.schedule()
    sched.add_request(_request("r", 10, remote=8))
    sched.schedule()
    assert sched.take_loads() == [] and sched.num_waiting == 1


# -- gather and scatter --------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_gather_then_scatter_moves_pages_exactly(kv_dtype):
    import jax
    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from serving.kv_transfer import pages

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8, intermediate_size=32)
    rng = np.random.default_rng(0)
    src = jax.tree.map(lambda a: jax.numpy.asarray(rng.normal(size=a.shape).astype(a.dtype)),
                       KVCache.zeros(cfg, 8, 4, kv_dtype))
    arrays = pages.gather(src, [3, 5, 6])
    assert {k: v.shape[1] for k, v in arrays.items()} == dict.fromkeys(arrays, 4)  # padded
    spec = pages.specs(pages.layout(src), 3, jax.devices()[0])
    assert {k: (v.shape, v.dtype) for k, v in spec.items()} == {
        k: (v.shape, v.dtype) for k, v in arrays.items()}
    dst = pages.scatter(KVCache.zeros(cfg, 8, 4, kv_dtype), [1, 2, 7], arrays)
    for name in pages.LEAVES:
        a, b = getattr(src, name), getattr(dst, name)
        if a is None:
            continue
        np.testing.assert_array_equal(np.asarray(b[:, [1, 2, 7]]), np.asarray(a[:, [3, 5, 6]]))
        assert not np.asarray(b[:, 3:7]).any()  # nothing else written (page 0: the sink)


# -- two servers ---------------------------------------------------------------------------------

def _serve(port: int, config: str, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "serving", "serve", *FLAGS,
                                 "--port", str(port), "--disable-log-stats",
                                 "--kv-transfer-config", config],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(producer HTTP port, consumer HTTP port, producer process)."""
    folder = tmp_path_factory.mktemp("pd")
    p_port, d_port, kv_port = free_port(), free_port(), free_port()
    producer = _serve(p_port, f'{{"kv_role": "kv_producer", "kv_port": {kv_port}, '
                              f'"kv_connector_extra_config": {{"side_channel_port": 0, '
                              f'"offer_timeout_s": {OFFER_TIMEOUT_S}}}}}',
                      folder / "producer.log")
    consumer = _serve(d_port, '{"kv_role": "kv_consumer", "kv_port": 0, '
                              '"kv_connector_extra_config": {"pull_timeout_s": 10}}',
                      folder / "consumer.log")
    try:
        for port, proc in ((p_port, producer), (d_port, consumer)):
            wait_healthy(port, 300, alive=lambda proc=proc: proc.poll() is None)
        yield p_port, d_port, producer
    finally:
        for proc in (producer, consumer):
            _stop(proc)
        for name in ("producer.log", "consumer.log"):
            print(f"--- {name}\n" + (folder / name).read_text(errors="replace")[-3000:])


def _sources(port: int) -> tuple[float, float]:
    m = metrics(port)
    return (metric(m, "xlaserve:prompt_tokens_by_source_total", source="local_compute"),
            metric(m, "xlaserve:prompt_tokens_by_source_total", source="external_kv_transfer"))


def _prefill(p_port: int, path: str, body: dict) -> dict:
    """The proxy's step 1; returns the prefill's kv_transfer_params."""
    status, out = post(p_port, path, {**body, "max_tokens": 1, "stream": False,
                                      "kv_transfer_params": {"do_remote_decode": True,
                                                             "do_remote_prefill": False}})
    assert status == 200, out
    assert out["kv_transfer_params"]["do_remote_prefill"] is True, out
    return out["kv_transfer_params"]


def _text(out: dict) -> str:
    choice = out["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("path, sampling", [
    ("/v1/completions", {"temperature": 0}),
    ("/v1/completions", {"temperature": 0.9, "seed": 1234}),
    ("/v1/chat/completions", {"temperature": 0}),
])
def test_decode_instance_answers_as_one_server_would(pd, path, sampling):
    p_port, d_port, _ = pd
    body = {"model": MODEL, "max_tokens": 24, "ignore_eos": True, **sampling,
            **({"prompt": PROMPT} if "chat" not in path else
               {"messages": [{"role": "user", "content": PROMPT}]})}
    status, alone = post(p_port, path, body)
    assert status == 200, alone
    params = _prefill(p_port, path, body)
    computed, pulled = _sources(d_port)
    status, out = post(d_port, path, {**body, "kv_transfer_params": params})
    assert status == 200, out
    assert _text(out) == _text(alone)
    assert out["usage"] == alone["usage"]
    assert "kv_transfer_params" not in out
    # the decode instance computed only the tail after the transferred pages
    num_prompt = alone["usage"]["prompt_tokens"]
    assert params["num_tokens"] == len(params["remote_block_ids"]) * 16 > 0
    assert _sources(d_port) == (computed + num_prompt - params["num_tokens"],
                                pulled + params["num_tokens"])


def test_unusable_params_fall_back_to_a_local_prefill(pd):
    p_port, d_port, _ = pd
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    status, alone = post(p_port, "/v1/completions", body)
    params = _prefill(p_port, "/v1/completions", body)
    for bad in ({**params, "kv_layout": [["k", [1, 16, 3, 64], "float16"]]},  # other layout
                {**params, "token_digest": "0" * 32},  # other tokens
                {"do_remote_prefill": True, "remote_block_ids": [1]}):  # another producer's
        _, pulled = _sources(d_port)
        status, out = post(d_port, "/v1/completions", {**body, "kv_transfer_params": bad})
        assert status == 200, out
        assert _text(out) == _text(alone) and _sources(d_port)[1] == pulled


def test_vllm_router_drives_the_pair(pd, tmp_path):
    """vllm-router's own disaggregated mode (NIXL's handshake) in front of the pair: the
    answers of one server, streamed and not, with the prompt's pages pulled."""
    import openai

    p_port, d_port, _ = pd
    port = free_port()
    with open(tmp_path / "router.log", "wb") as log:
        router = subprocess.Popen(
            [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1",
             "--port", str(port), "--vllm-pd-disaggregation",
             "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, 60, alive=lambda: router.poll() is None)
        body = {"model": MODEL, "prompt": PROMPT + "the", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        status, alone = post(p_port, "/v1/completions", body)
        assert status == 200, alone
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        _, pulled = _sources(d_port)
        fields = {k: v for k, v in body.items() if k != "ignore_eos"}
        extra = {"extra_body": {"ignore_eos": True}}
        out = client.completions.create(**fields, **extra)
        assert out.choices[0].text == _text(alone)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **fields, **extra, stream=True) if c.choices)
        assert streamed == _text(alone)
        assert _sources(d_port)[1] >= pulled + 2 * 16  # both pulled the prompt's pages
    finally:
        router.kill()
        router.wait()


def _used(port: int) -> float:
    return metric(metrics(port), "xlaserve:kv_cache_usage_perc")


def test_an_offer_never_pulled_is_freed_and_then_refused(pd):
    p_port, d_port, _ = pd
    body = {"model": MODEL, "prompt": "Never pulled: " + PROMPT, "max_tokens": 8,
            "temperature": 0}
    wait_until(lambda: _used(p_port) == 0, 30, "the producer's pages to come back")
    params = _prefill(p_port, "/v1/completions", body)
    assert _used(p_port) > 0  # held for the decode instance
    wait_until(lambda: _used(p_port) == 0, OFFER_TIMEOUT_S + 10, "the offer to expire")
    _, pulled = _sources(d_port)
    status, out = post(d_port, "/v1/completions", {**body, "kv_transfer_params": params})
    assert status == 200 and _sources(d_port)[1] == pulled  # claim refused: computed here
    status, alone = post(p_port, "/v1/completions", body)
    assert _text(out) == _text(alone)


def test_a_killed_producer_means_a_local_prefill(pd):
    """Last: it stops the producer."""
    p_port, d_port, producer = pd
    body = {"model": MODEL, "prompt": "Killed: " + PROMPT, "max_tokens": 12,
            "temperature": 0}
    status, alone = post(p_port, "/v1/completions", body)
    params = _prefill(p_port, "/v1/completions", body)
    producer.kill()
    producer.wait(30)
    _, pulled = _sources(d_port)
    status, out = post(d_port, "/v1/completions", {**body, "kv_transfer_params": params})
    assert status == 200, out
    assert _text(out) == _text(alone) and _sources(d_port)[1] == pulled
    wait_until(lambda: _used(d_port) == 0, 30, "the consumer's pages to come back")
