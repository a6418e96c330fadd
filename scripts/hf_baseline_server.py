"""The transformers baseline of scripts/bench_side_by_side.py: a minimal OpenAI streaming
server (/v1/completions, /v1/models, /health) over transformers `generate`, with static batches:
requests that arrive while a batch runs wait for the next one. `/v1/embeddings` (float only)
batches the same way: the base model's last hidden state at each input's last token (LAST
pooling, inputs padded on the left), normalized, as `xlaserve serve --task embed` pools.

    python scripts/hf_baseline_server.py --model HF_DIR --port P [--max-batch 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path


class _BatchStreamer:
    """A transformers streamer for a batch: generate() calls put() with the prompt ids, then with
    each step's new token per row; every row's new text goes to its request's asyncio queue."""

    def __init__(self, jobs, tokenizer, loop):
        self.jobs, self.tok, self.loop = jobs, tokenizer, loop
        self.ids = [[] for _ in jobs]
        self.sent = ["" for _ in jobs]
        self.done = [False for _ in jobs]
        self.prompt_seen = False

    def _emit(self, i: int, text: str, finish: str | None) -> None:
        self.loop.call_soon_threadsafe(self.jobs[i]["queue"].put_nowait, (text, finish))

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for i, token in enumerate(value.reshape(-1).tolist()):
            job = self.jobs[i]
            if self.done[i]:
                continue
            if token in job["eos"] and not job["ignore_eos"]:
                self.done[i] = True
                self._emit(i, "", "stop")
                continue
            self.ids[i].append(token)
            text = self.tok.decode(self.ids[i], skip_special_tokens=True)
            new = "" if text.endswith("\ufffd") else text[len(self.sent[i]):]
            self.sent[i] += new
            self.done[i] = len(self.ids[i]) >= job["max_tokens"]
            self._emit(i, new, "length" if self.done[i] else None)

    def end(self) -> None:
        for i, done in enumerate(self.done):
            if not done:
                self._emit(i, "", "length")


def hf_app(model_dir: str, max_batch: int):
    import torch
    from aiohttp import web
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = set(model.generation_config.eos_token_id if isinstance(
        model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
    pending: asyncio.Queue = asyncio.Queue()
    name = Path(model_dir).name

    def generate(jobs, loop) -> None:
        enc = tok([j["prompt"] for j in jobs], return_tensors="pt", padding=True)
        new = max(j["max_tokens"] for j in jobs)
        extra = {"min_new_tokens": new} if all(j["ignore_eos"] for j in jobs) else {}
        streamer = _BatchStreamer(jobs, tok, loop)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=pad,
                           streamer=streamer, **extra)

    async def batcher(app):
        async def loop_forever():
            while True:
                jobs = [await pending.get()]
                while len(jobs) < max_batch and not pending.empty():
                    jobs.append(pending.get_nowait())
                try:
                    await asyncio.to_thread(generate, jobs, asyncio.get_running_loop())
                except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                    for j in jobs:
                        j["queue"].put_nowait((f"[error: {e}]", "error"))
        task = asyncio.create_task(loop_forever())
        yield
        task.cancel()

    async def completions(request):
        body = await request.json()
        prompt = body["prompt"]
        job = {"prompt": prompt, "max_tokens": int(body.get("max_tokens", 16)),
               "ignore_eos": bool(body.get("ignore_eos")), "eos": eos, "queue": asyncio.Queue()}
        await pending.put(job)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created, count = int(time.time()), 0
        while True:
            text, finish = await job["queue"].get()
            count += finish != "stop"
            chunk = {"id": "cmpl-hf", "object": "text_completion", "created": created,
                     "model": name, "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if finish:
                break
        if (body.get("stream_options") or {}).get("include_usage"):
            n_in = len(tok(prompt)["input_ids"])
            usage = {"prompt_tokens": n_in, "completion_tokens": count,
                     "total_tokens": n_in + count}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    embed_pending: asyncio.Queue = asyncio.Queue()

    def embed(jobs) -> None:
        enc = tok([j["input"] for j in jobs], return_tensors="pt", padding=True)
        with torch.inference_mode():
            hidden = model.model(**enc).last_hidden_state[:, -1].float()
        vectors = torch.nn.functional.normalize(hidden, dim=-1)
        for j, v, n in zip(jobs, vectors, enc["attention_mask"].sum(1).tolist()):
            j["result"] = (v.tolist(), n)

    async def embed_batcher(app):
        async def loop_forever():
            while True:
                jobs = [await embed_pending.get()]
                while len(jobs) < max_batch and not embed_pending.empty():
                    jobs.append(embed_pending.get_nowait())
                try:
                    await asyncio.to_thread(embed, jobs)
                except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                    for j in jobs:
                        j["result"] = e
                for j in jobs:
                    j["done"].set()
        task = asyncio.create_task(loop_forever())
        yield
        task.cancel()

    async def embeddings(request):
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        jobs = [{"input": text, "done": asyncio.Event()} for text in inputs]
        for j in jobs:
            await embed_pending.put(j)
        for j in jobs:
            await j["done"].wait()
        if any(isinstance(j["result"], Exception) for j in jobs):
            return web.json_response({"error": {"message": "embedding failed"}}, status=500)
        data = [{"object": "embedding", "index": i, "embedding": j["result"][0]}
                for i, j in enumerate(jobs)]
        n = sum(j["result"][1] for j in jobs)
        return web.json_response({"object": "list", "data": data, "model": name,
                                  "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.cleanup_ctx.append(batcher)
    app.cleanup_ctx.append(embed_batcher)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import torch
    from aiohttp import web
    torch.set_num_threads(args.threads)
    web.run_app(hf_app(args.model, args.max_batch), host="127.0.0.1", port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
