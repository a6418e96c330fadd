"""The access log: one line per request with method, path, status and tokens, never the
prompt, the output or the API key; off with access_log=False (--disable-access-log)."""
import asyncio
import logging
import re

from tests.test_protocol import MODEL, engine, serve, tokenizer  # noqa: F401 - fixtures

LINE = re.compile(r"^(GET|POST) (\S+) (\d{3})( prompt_tokens=(\d+) completion_tokens=(\d+))? "
                  r"\d+\.\d{3}s$")


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "xlaserve.access"]


def test_one_line_per_request_without_prompts_or_keys(engine, tokenizer, caplog):  # noqa: F811
    prompt = "a secret prompt about foxes"

    async def go():
        async with serve(engine, api_key="sk-hidden") as client:
            auth = {"Authorization": "Bearer sk-hidden"}
            ok = await client.post("/v1/completions?note=sk-hidden", headers=auth, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0})
            assert ok.status == 200
            body = await ok.json()
            streamed = await client.post("/v1/completions", headers=auth, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True})
            await streamed.read()
            assert (await client.post("/v1/completions", json={})).status == 401
            assert (await client.post("/v1/completions", headers=auth,
                                      json={"model": MODEL})).status == 400
            assert (await client.get("/health")).status == 200
            return body

    with caplog.at_level(logging.INFO, logger="xlaserve.access"):
        body = asyncio.run(go())
    got = lines(caplog)
    assert len(got) == 5
    parsed = [LINE.match(line) for line in got]
    assert all(parsed), got
    usage = body["usage"]
    assert [(m[1], m[2], m[3]) for m in parsed] == [
        ("POST", "/v1/completions", "200"), ("POST", "/v1/completions", "200"),
        ("POST", "/v1/completions", "401"), ("POST", "/v1/completions", "400"),
        ("GET", "/health", "200")]
    assert (int(parsed[0][5]), int(parsed[0][6])) == (usage["prompt_tokens"],
                                                       usage["completion_tokens"])
    assert int(parsed[1][6]) == 2  # a streamed response counts its tokens too
    assert parsed[2][4] is None and parsed[4][4] is None  # no tokens where none ran
    text = "\n".join(got)
    assert "secret" not in text and "sk-hidden" not in text and "foxes" not in text


def test_disabled(engine, caplog):  # noqa: F811
    async def go():
        async with serve(engine, access_log=False) as client:
            assert (await client.get("/health")).status == 200

    with caplog.at_level(logging.INFO, logger="xlaserve.access"):
        asyncio.run(go())
    assert lines(caplog) == []
