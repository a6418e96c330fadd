"""The soak script's short setting: scripts/soak.py starts `python -m serving` on the demo
model, sends mixed traffic (some clients leave part-way) for 15 s, and must find nothing
lost, no page leaked, every finished choice counted by both sides, and a clean exit. The
long setting runs by hand: `python scripts/soak.py --duration 600`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_util import CLI_FLAGS, MODEL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def table(stdout: str) -> dict[str, str]:
    rows = [line.strip("|").split("|") for line in stdout.splitlines()
            if line.startswith("| ") and line.count("|") == 3]
    return {name.strip(): value.strip() for name, value in rows}


def test_short_soak_loses_nothing(demo_checkpoint):
    cmd = [sys.executable, "scripts/soak.py", "--duration", "15", "--warmup", "3",
           "--concurrency", "8", "--max-tokens", "16", "--disconnect-share", "0.4",
           "--", "--model", str(demo_checkpoint), "--served-model-name", MODEL, *CLI_FLAGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert rows["lost"] == "0" and rows["pages leaked"] == "0", rows
    assert rows["after: running / waiting / KV cache usage"] == "0 / 0 / 0", rows
    clients, server = rows["choices finished: clients / server"].split(" / ")
    assert clients == server and int(clients) > 0, rows
    assert int(rows["aborted by their client"]) > 0 and int(rows["finished"]) > 0, rows
    assert "server RSS after warm-up / at end (MiB)" in rows
    assert "soak: PASS" in proc.stdout and "the server exited with 0" in proc.stdout


def test_soak_reports_streams_the_server_drops(tmp_path):
    """Against a server that cuts every stream short and answers everything else, the soak
    must count the cut streams as lost and fail."""
    import asyncio
    import threading

    from aiohttp import web

    async def models(request):
        return web.json_response({"data": [{"id": "m"}]})

    async def metrics(request):
        return web.Response(text="xlaserve:num_requests_running 0\n")

    async def generate(request):
        body = await request.json()
        choices = [{"index": i, "finish_reason": "length"} for i in range(body["n"])]
        if not body.get("stream"):
            return web.json_response({"choices": choices})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": []}\n\n')
        request.transport.close()  # gone without [DONE]
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        proc = subprocess.run(
            [sys.executable, "scripts/soak.py", "--url", f"http://127.0.0.1:{port}",
             "--duration", "2", "--warmup", "0", "--concurrency", "2",
             "--disconnect-share", "0", "--stream-share", "0.5"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    print(proc.stdout)
    rows = table(proc.stdout)
    assert int(rows["lost"]) > 0 and int(rows["finished"]) > 0, rows
    assert "lost: the stream ended without [DONE]" in proc.stdout or \
        "lost: ClientPayloadError" in proc.stdout, proc.stdout
