"""A tokenizer that knows more ids than the model embeds (a small Llama with 389 embedding
rows served with SmolLM2's 49,152-token tokenizer): the server starts, structured outputs
work over the ids the model can emit, and a prompt id past the table is a 400."""
from __future__ import annotations

import re
import shutil

import pytest

from tests.hf_tiny import tiny_hf_model
from tests.server_util import MODEL, live_server, post

ROWS = 389


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_model_dir):
    folder = tmp_path_factory.mktemp("vocab-mismatch")
    tiny_hf_model("llama", folder, seed=3, vocab_size=ROWS)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo_model_dir / name).is_file():
            shutil.copy(demo_model_dir / name, folder / name)
    with live_server(folder) as live:
        yield live


def test_tokenizer_larger_than_the_embedding_serves(server):
    assert len(server.tokenizer) > ROWS and server.engine.vocab_size == ROWS
    status, body = post(server.port, "/v1/completions", {
        "model": MODEL, "prompt": [5, 17, 300], "max_tokens": 12, "temperature": 0,
        "structured_outputs": {"regex": "[a-z]{4,8}"}})
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert re.fullmatch("[a-z]{4,8}", text), text


def test_a_prompt_id_past_the_embedding_is_refused(server):
    status, body = post(server.port, "/v1/completions", {
        "model": MODEL, "prompt": [5, ROWS + 10], "max_tokens": 2})
    assert status == 400, body
    assert str(ROWS + 10) in body["error"]["message"]
