"""Embeddings (`--task embed`): the scheduler runs an embedding request as a prompt that
finishes when computed (no token, no prefix cache either way); vectors equal transformers'
last_hidden_state pooled the same way (LAST, MEAN, CLS; float32) on the demo model and a
tiny Qwen3, with prompts longer than one prefill chunk and the default buckets; the same
vector alone and in any batch, bit for bit; then /v1/embeddings through the real `openai`
client, its refusals, and the generation routes refused on an embedding server."""
from __future__ import annotations

import base64
import gc
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving.core.pooling_params import (EmbeddingSpec, PoolerConfig, PoolingParams,
                                         default_pooler_config, resolve_task)
from serving.core.request import Request, RequestStatus
from serving.core.request_checks import RequestRefused
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
COSINE = 0.99999
LONG = 700  # tokens: more than one prefill chunk of the default 512-token budget


# -- host side: the scheduler and the pooler config, no JAX ------------------------------

def _scheduler(budget=32, pages=64):
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                     max_model_len=128, page_size=4, num_pages=pages))


def _embedding_request(rid, tokens):
    return Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=1),
                   pooling_params=PoolingParams())


def test_scheduler_finishes_embedding_after_its_prompt_and_keeps_nothing():
    s = _scheduler()
    prompt = list(range(1, 71))  # 70 tokens: three chunks of the 32-token budget
    s.add_request(_embedding_request("e", prompt))
    steps = 0
    while s.has_unfinished:
        out = s.schedule()
        assert [x.num_new_tokens for x in out.scheduled] == [min(32, 70 - 32 * steps)]
        changed = s.update(out, [123] * len(out.scheduled))
        steps += 1
    req = changed[0]
    assert steps == 3 and req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == []  # the sampled row's token is never appended
    assert s.allocator.num_used_pages == 0 and s.allocator.num_cached_pages == 0
    # The same prompt again reads nothing from the cache, and a generation request with it
    # finds nothing an embedding left behind.
    again = _embedding_request("e2", prompt)
    assert s.kv_cache_manager.get_computed_pages(again) == []
    gen = Request("g", prompt, SamplingParams(max_tokens=2))
    assert s.kv_cache_manager.get_computed_pages(gen) == []
    assert s.kv_cache_manager.prefix_cache_hits == 0


def test_embedding_may_fill_the_context_but_not_more():
    s = _scheduler(pages=64)
    s.add_request(_embedding_request("full", list(range(128))))  # no room for output needed
    with pytest.raises(RequestRefused) as e:
        s.add_request(_embedding_request("over", list(range(129))))
    assert e.value.code == "context_length_exceeded"


def test_pooler_config_names_defaults_and_refusals(tmp_path):
    assert PoolerConfig.parse(None) == PoolerConfig("LAST", True)
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == \
        PoolerConfig("MEAN", False)
    assert PoolerConfig.parse({"seq_pooling_type": "CLS", "use_activation": False}) == \
        PoolerConfig("CLS", False)
    for bad in ('{"pooling_type": "MAX"}', '{"pooling": "LAST"}', "[1]", "{",
                '{"normalize": "yes"}', '{"pooling_type": "CLS", "seq_pooling_type": "MEAN"}'):
        with pytest.raises(ValueError):
            PoolerConfig.parse(bad)
    # sentence-transformers' files give the default: mean pooling, then Normalize
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert default_pooler_config(tmp_path) == PoolerConfig("MEAN", True)
    assert PoolerConfig.parse('{"pooling_type": "LAST"}', tmp_path) == PoolerConfig("LAST", True)
    assert resolve_task("generate", "pooling") == "embed"
    with pytest.raises(ValueError):
        resolve_task("embed", "generate")


def test_dimensions_follow_the_model_config(tmp_path):
    plain = EmbeddingSpec("m", 64, PoolerConfig())
    with pytest.raises(RequestRefused, match="Matryoshka"):
        plain.resolve(PoolingParams(dimensions=32))
    assert plain.resolve(PoolingParams()) == PoolingParams(None, True)
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [16, 64]}))
    listed = EmbeddingSpec.from_dir(tmp_path, 64, PoolerConfig("MEAN", False))
    assert listed.resolve(PoolingParams(dimensions=16)) == PoolingParams(16, False)
    with pytest.raises(RequestRefused, match=r"\[16, 64\]"):
        listed.resolve(PoolingParams(dimensions=32))
    (tmp_path / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    free = EmbeddingSpec.from_dir(tmp_path, 64, PoolerConfig())
    assert free.resolve(PoolingParams(dimensions=5, normalize=False)).dimensions == 5
    with pytest.raises(RequestRefused, match="64"):
        free.resolve(PoolingParams(dimensions=65))


# -- the engine against transformers ------------------------------------------------------

_HIDDEN: dict = {}  # (model, prompt) -> transformers' last_hidden_state, shared by the kinds


def _reference(hf, tokens, kind, normalize=True):
    """transformers' base model: last_hidden_state (after the final norm), pooled."""
    import torch
    key = (id(hf), tuple(tokens))
    if key not in _HIDDEN:
        with torch.no_grad():
            _HIDDEN[key] = hf.model(torch.tensor([tokens])).last_hidden_state[0].double().numpy()
    h = _HIDDEN[key]
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return v / np.linalg.norm(v) if normalize else v


def _cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _prompts(vocab_size, seed):
    """A long prompt (chunked), short ones, one of a single token."""
    rng = random.Random(seed)
    lengths = (LONG, 37, 1, 130, 16)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def torch_one_thread():
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def demo_hf(demo_model_dir, torch_one_thread):
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        demo_model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, torch_one_thread):
    from model.checkpoint import convert_hf
    from tests.hf_tiny import tiny_hf_model
    root = tmp_path_factory.mktemp("qwen3")
    hf = tiny_hf_model("qwen3", root / "hf", max_position_embeddings=1024)
    convert_hf(root / "hf", root / "ckpt", "float32", progress=False)
    return hf, root / "ckpt"


def _check_engine(llm, hf, prompts, kind, normalize=True):
    """Each prompt alone and all batched: bitwise the same; against transformers: cosine."""
    from tests.test_engine import counting_compilations
    params = PoolingParams(normalize=normalize)
    with counting_compilations() as events:
        alone = [llm.embed(p, params)[0].outputs.embedding for p in prompts]
        batched = [r.outputs.embedding for r in llm.embed(prompts, params)]
    assert events == []  # nothing compiles after warm-up
    assert batched == alone  # bit for bit
    engine = llm.engine
    assert engine.scheduler.allocator.num_used_pages == 0
    assert engine.scheduler.allocator.num_cached_pages == 0
    assert engine.scheduler.kv_cache_manager.prefix_cache_hits == 0
    for p, got in zip(prompts, alone):
        want = _reference(hf, p, kind, normalize)
        assert len(got) == hf.config.hidden_size
        assert _cosine(got, want) >= COSINE, (kind, len(p), _cosine(got, want))
        if not normalize:
            assert np.allclose(np.linalg.norm(got), np.linalg.norm(want), rtol=1e-4)
        else:
            assert abs(np.linalg.norm(got) - 1) < 1e-5


def _embed_llm(ckpt, kind, normalize=True, **options):
    from serving import LLM
    config = json.dumps({"pooling_type": kind, "normalize": normalize})
    # The default flags and buckets but a small KV cache: a few sequences of the context.
    return LLM(str(ckpt), task="embed", pooler_config=config, max_num_seqs=4,
               progress=False, **options)


@pytest.mark.parametrize("kind,normalize", [("LAST", True), ("MEAN", False), ("CLS", True)])
def test_demo_model_equals_transformers(demo_checkpoint, demo_hf, kind, normalize):
    llm = _embed_llm(demo_checkpoint, kind, normalize)
    engine = llm.engine
    assert engine.buckets.tokens[-1] == 512 and engine.max_model_len > LONG  # the defaults
    # Every step program, the prompt-logprobs one and the pooling one.
    assert engine.warmup_report.programs == len(engine.step_shapes) + 2
    prompts = _prompts(engine.vocab_size, seed=1)
    prompts.append(llm.tokenizer.encode("Paged attention keeps the KV cache in pages."))
    _check_engine(llm, demo_hf, prompts, kind, normalize)
    del llm, engine
    gc.collect()


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_tiny_qwen3_equals_transformers(qwen3, kind):
    hf, ckpt = qwen3
    llm = _embed_llm(ckpt, kind)
    _check_engine(llm, hf, _prompts(hf.config.vocab_size, seed=2), kind)


def test_matryoshka_dimensions_cut_before_normalizing(qwen3):
    hf, ckpt = qwen3
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [24, 72]}))
    try:
        llm = _embed_llm(ckpt, "MEAN", max_model_len=256)
        prompt = _prompts(hf.config.vocab_size, seed=3)[1]
        full = llm.embed(prompt, PoolingParams(normalize=False))[0].outputs.embedding
        cut = llm.embed(prompt, PoolingParams(dimensions=24))[0].outputs.embedding
        want = np.asarray(full[:24], np.float64)
        assert len(cut) == 24 and np.allclose(cut, want / np.linalg.norm(want), atol=1e-6)
        with pytest.raises(RequestRefused, match="dimensions"):
            llm.embed(prompt, PoolingParams(dimensions=30))
        with pytest.raises(ValueError, match="task embed"):
            llm.generate(prompt)
    finally:
        (ckpt / "config.json").write_text(json.dumps(config))


# -- HTTP: the real openai client against an embedding server -----------------------------

@pytest.fixture(scope="module")
def embed_server(demo_checkpoint):
    from tests.server_util import live_server
    with live_server(demo_checkpoint, task="embed") as server:
        yield server


def test_openai_client_embeddings(embed_server):
    from tests.server_util import MODEL
    client = embed_server.client()
    texts = ["Hello there.", "Embeddings come from the last hidden state.", "x " * 150]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == [0, 1, 2]
    ids = [embed_server.tokenizer.encode(t) for t in texts]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # The client's default is base64 (little-endian float32), which it decodes itself.
    b64 = client.embeddings.create(model=MODEL, input=texts)
    assert [d.embedding for d in b64.data] == [d.embedding for d in floats.data]
    for text, d in zip(texts, floats.data):  # each alone: the same bits
        assert len(d.embedding) == 576 and abs(np.linalg.norm(d.embedding) - 1) < 1e-5
        one = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        assert one.data[0].embedding == d.embedding
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in floats.data]
    single = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert single.data[0].embedding == floats.data[1].embedding
    raw = client.embeddings.with_raw_response.create(
        model=MODEL, input=texts[0], encoding_format="base64",
        extra_body={"normalize": False}).http_response.json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert _cosine(vec, floats.data[0].embedding) > 0.999999 and np.linalg.norm(vec) > 1.5
    assert [m.id for m in client.models.list().data] == [MODEL]
    embed_server.wait_idle()


def test_bad_embedding_requests_are_clear_4xx(embed_server):
    from tests.server_util import MODEL, assert_error, post
    port = embed_server.port
    cases = [
        ({"model": MODEL}, 400, "input", None),
        ({"input": ""}, 400, "input", None),
        ({"input": []}, 400, "input", None),
        ({"input": [[]]}, 400, "input", None),
        ({"input": ["a", [1, 2]]}, 400, "input", None),
        ({"input": [1, -2]}, 400, "input", None),
        ({"input": {"text": "a"}}, 400, "input", None),
        ({"input": [10 ** 6]}, 400, "input", None),
        ({"input": [5] * 257}, 400, "input", "context_length_exceeded"),
        ({"input": "hi", "encoding_format": "binary"}, 400, "encoding_format", None),
        ({"input": "hi", "dimensions": 32}, 400, "dimensions", None),
        ({"input": "hi", "dimensions": 0}, 400, "dimensions", None),
        ({"input": "hi", "normalize": "yes"}, 400, "normalize", None),
        ({"input": "hi", "user": 5}, 400, "user", None),
        ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages",
         "unsupported_parameter"),
        ({"input": "hi", "model": "other"}, 404, "model", "model_not_found"),
    ]
    for body, status, param, code in cases:
        got_status, got = post(port, "/v1/embeddings", body)
        assert_error(got_status, got, status, param=param, code=code)
    # A long input is fine once truncated to its last tokens, as vLLM's
    # truncate_prompt_tokens does.
    status, body = post(port, "/v1/embeddings", {"input": [7] * 300 + [9] * 20,
                                                 "truncate_prompt_tokens": 20})
    assert status == 200 and body["usage"]["prompt_tokens"] == 20
    status, same = post(port, "/v1/embeddings", {"input": [9] * 20})
    assert same["data"][0]["embedding"] == body["data"][0]["embedding"]
    embed_server.wait_idle()


def test_generation_routes_refused_on_an_embedding_server(embed_server):
    import openai
    from tests.server_util import MODEL, assert_error, get_json, post
    port = embed_server.port
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"})):
        status, got = post(port, path, {"model": MODEL, **body})
        assert_error(status, got, 400, code="unsupported_task")
        assert "--task embed" in got["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        embed_server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    status, spec = get_json(port, "/openapi.json")
    assert status == 200 and "/v1/embeddings" in spec["paths"]
    assert not any(p.startswith(("/v1/completions", "/v1/chat", "/v1/responses"))
                   for p in spec["paths"])


def test_embedding_route_refused_on_a_generation_server(shared_server):
    from tests.server_util import MODEL, assert_error, get_json, post
    status, got = post(shared_server.port, "/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert_error(status, got, 400, code="unsupported_task")
    assert "--task embed" in got["error"]["message"]
    status, spec = get_json(shared_server.port, "/openapi.json")
    assert "/v1/embeddings" not in spec["paths"] and "/v1/completions" in spec["paths"]
    engine = shared_server.engine  # a generation engine builds no pooling program
    assert engine.runner.pooling is None
    assert engine.warmup_report.programs == len(engine.step_shapes) + 1


def test_schemathesis_over_the_embedding_server(embed_server, tmp_path):
    from tests.test_openapi_contract import CHECKS
    url = f"http://127.0.0.1:{embed_server.port}/openapi.json"
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", url, "--checks", CHECKS,
           "--phases", "fuzzing", "--max-examples", "12", "--seed", "7", "--workers", "2",
           "--request-timeout", "120", "--generation-database", "none", "--no-color",
           "--include-path", "/v1/embeddings"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(ROOT / "tests" / "schemathesis_hooks.py")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    summary = proc.stdout[proc.stdout.find("SUMMARY"):]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
    embed_server.wait_idle()
