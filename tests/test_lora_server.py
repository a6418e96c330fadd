"""LoRA through `xlaserve serve` and the openai client: `model` picks the adapter, /v1/models
lists them, adapters load and unload at run time, and a reload under the same name answers
with the new weights (no stale prefix-cache pages)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hf_tiny import greedy_reference, tiny_hf_model
from tests.lora_tiny import make_adapter
from tests.server_util import free_port, get_json, post, request, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 6
PROMPT = [(11 * i) % 4000 + 20 for i in range(21)]  # two pages and a bit: cacheable
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_model_dir):
    folder = tmp_path_factory.mktemp("lora_server")
    # the demo model's vocabulary, so its tokenizer turns the ids into text
    base = tiny_hf_model("llama", folder / "base", vocab_size=49152)
    for name in TOKENIZER_FILES:
        if (demo_model_dir / name).exists():
            shutil.copy(demo_model_dir / name, folder / "base" / name)
    refs = {None: greedy_reference(base, PROMPT, MAX_TOKENS)}
    for seed, (name, kind) in enumerate([("sql", "sql"), ("poet", "poet"),
                                         ("sql2", "sql"), ("chat", "chat")]):
        model = make_adapter(base, kind, folder / name, seed=seed, size=0.5)
        refs[name] = greedy_reference(model, PROMPT, MAX_TOKENS)
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    cmd = [sys.executable, "-m", "serving", "serve", str(folder / "base"),
           "--served-model-name", "tiny", "--port", str(port), "--max-model-len", "128",
           "--max-num-seqs", "8", "--enable-lora", "--max-loras", "2",
           "--lora-modules", f"sql={folder / 'sql'}",
           f'{{"name": "poet", "path": "{folder / "poet"}", "base_model_name": "tiny-base"}}']
    log_path = folder / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, 600, alive=lambda: proc.poll() is None)
        yield port, folder, refs, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                                api_key="none")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(log_path.read_text(errors="replace")[-3000:])


def streamed_text(client, model: str, max_tokens: int = MAX_TOKENS, chunks=None) -> str:
    """chunks: a list the stream's texts are appended to as they arrive."""
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = [] if chunks is None else chunks
    for c in stream:
        text += [c.choices[0].text] if c.choices else []
    return "".join(text)


def decoded(folder, ids) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder / "base").decode(ids)


def test_model_field_picks_the_adapter(server):
    port, folder, refs, client = server
    assert refs["sql"] != refs[None] and refs["poet"] != refs["sql"]
    for model, ref in (("tiny", None), ("sql", "sql"), ("poet", "poet")):
        assert streamed_text(client, model) == decoded(folder, refs[ref]), model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        streamed_text(client, "chat")


def test_every_generation_route_serves_the_adapter_and_names_it(server):
    port, folder, refs, client = server
    done = client.completions.create(model="poet", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert (done.model, done.choices[0].text) == ("poet", decoded(folder, refs["poet"]))
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = {m: client.chat.completions.create(model=m, messages=messages, max_tokens=8,
                                              temperature=0) for m in ("tiny", "sql")}
    assert chat["sql"].model == "sql"
    assert chat["sql"].choices[0].message.content != chat["tiny"].choices[0].message.content
    resp = {m: client.responses.create(model=m, input="Name a colour.", max_output_tokens=8,
                                       temperature=0) for m in ("tiny", "sql")}
    assert resp["sql"].model == "sql" and resp["sql"].output_text != resp["tiny"].output_text
    assert resp["sql"].output_text == chat["sql"].choices[0].message.content


def test_models_lists_adapters_with_root_and_parent(server):
    port, folder, refs, client = server
    status, body = get_json(port, "/v1/models")
    cards = {c["id"]: c for c in body["data"]}
    assert status == 200 and {"tiny", "sql", "poet"} <= set(cards)
    assert cards["sql"]["root"] == str(folder / "sql") and cards["sql"]["parent"] == "tiny"
    assert cards["poet"]["parent"] == "tiny-base"
    assert get_json(port, "/v1/models/poet")[1]["root"] == str(folder / "poet")
    spec = get_json(port, "/openapi.json")[1]
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(spec["paths"])
    assert '"poet"' in json.dumps(spec["paths"]["/v1/chat/completions"])  # a valid `model`


def test_load_unload_and_reload_under_the_same_name(server):
    port, folder, refs, client = server
    load = lambda body: request(port, "POST", "/v1/load_lora_adapter", body)
    unload = lambda body: request(port, "POST", "/v1/unload_lora_adapter", body)
    status, _, text = load({"lora_name": "chat", "lora_path": str(folder / "chat")})
    assert (status, text) == (200, b"Success: LoRA adapter 'chat' added successfully.")
    assert streamed_text(client, "chat") == decoded(folder, refs["chat"])
    assert load({"lora_name": "chat", "lora_path": str(folder / "chat")})[0] == 400
    assert post(port, "/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400
    assert load({"lora_name": "x", "lora_path": str(folder / "missing")})[0] == 404
    assert load({"lora_name": "x", "lora_path": str(folder / "base")})[0] == 400  # not PEFT
    assert unload({"lora_name": "nope"})[0] == 404

    assert streamed_text(client, "sql") == decoded(folder, refs["sql"])  # its pages cached
    status, _, text = unload({"lora_name": "sql"})
    assert (status, text) == (200, b"Success: LoRA adapter 'sql' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        streamed_text(client, "sql")
    assert load({"lora_name": "sql", "lora_path": str(folder / "sql2")})[0] == 200
    assert refs["sql2"] != refs["sql"]
    assert streamed_text(client, "sql") == decoded(folder, refs["sql2"])


def test_lora_requests_info_metric(server):
    port, folder, refs, client = server
    streamed_text(client, "poet")
    status, _, raw = request(port, "GET", "/metrics")
    samples = [s for f in text_string_to_metric_families(raw.decode())
               if f.name == "xlaserve:lora_requests_info" for s in f.samples]
    assert status == 200 and len(samples) == 1
    assert samples[0].labels["max_lora"] == "2"
    assert samples[0].labels["running_lora_adapters"] == ""  # nothing runs between requests
    assert samples[0].value > 1e9  # the time of the update


def test_unload_waits_for_the_adapters_running_requests(server):
    port, folder, refs, client = server
    assert request(port, "POST", "/v1/load_lora_adapter",
                   {"lora_name": "poet2", "lora_path": str(folder / "poet")})[0] == 200
    chunks = []
    thread = threading.Thread(target=streamed_text, args=(client, "poet2", 100, chunks))
    thread.start()
    deadline = time.monotonic() + 120
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    status, _, _ = request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "poet2"})
    received = len(chunks)  # the engine finished the request; the last chunks may be in flight
    thread.join(120)
    assert status == 200 and len(chunks) >= 50 and received >= len(chunks) - 10
