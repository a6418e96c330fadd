"""LoRA adapters over HTTP, as vLLM serves them: the `model` field names an adapter
(prompts.check_model), `/v1/models` lists them with `root` (their folder) and `parent`, and
with XLASERVE_ALLOW_RUNTIME_LORA_UPDATING=1 (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` change them while serving."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from aiohttp import web

from serving.lora.request import LoRAError
from serving.openai import protocol as p
from serving.openai.http_guard import read_json
from serving.openai.server_state import STATE, ServerState

log = logging.getLogger("xlaserve")
RUNTIME_UPDATING = ("XLASERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
_UNLOAD_POLL_S = 0.05


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true")
               for k in RUNTIME_UPDATING)


def manager(state: ServerState):
    return getattr(state.engine, "lora", None)


def card(state: ServerState, adapter) -> dict:
    return {"id": adapter.lora_name, "object": "model", "created": state.created,
            "owned_by": "xlaserve", "root": adapter.lora_path,
            "parent": adapter.base_model_name or state.model,
            "max_model_len": state.engine.max_model_len}


def cards(state: ServerState) -> list[dict]:
    m = manager(state)
    return [] if m is None else [card(state, a) for a in list(m.named.values())]


def add_routes(app: web.Application) -> None:
    if runtime_updating_allowed():
        log.warning("runtime LoRA updating is on (/v1/load_lora_adapter, "
                    "/v1/unload_lora_adapter): this should only be used for local development")
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


def _lora_manager(state: ServerState):
    m = manager(state)
    if m is None:
        raise p.ProtocolError("this server serves no LoRA adapters: start it with "
                              "--enable-lora", code="lora_disabled")
    return m


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    name, path = p.opt_str(body, "lora_name"), p.opt_str(body, "lora_path")
    if not name or not path:
        raise p.ProtocolError("Both 'lora_name' and 'lora_path' must be provided.",
                              param="lora_name" if not name else "lora_path")
    m = _lora_manager(state)
    if name == state.model or name in m.named:
        raise p.ProtocolError(f"The lora adapter '{name}' has already been loaded.",
                              param="lora_name", code="lora_already_loaded")
    if not Path(path).exists():
        raise p.ProtocolError(f"Loading lora {name} failed: No adapter found for {path}",
                              status=404, param="lora_path", code="lora_not_found")
    try:  # reading the folder is file work: off the event loop
        await asyncio.get_running_loop().run_in_executor(None, m.register, name, path)
    except LoRAError as e:
        raise p.ProtocolError(f"Loading lora {name} failed: {e}", param="lora_path",
                              code="invalid_lora") from None
    log.info("LoRA adapter %r loaded from %s", name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """The name stops resolving at once; the reply waits for the adapter's running requests
    to finish."""
    state = request.app[STATE]
    body = await read_json(request)
    name = p.opt_str(body, "lora_name")
    if not name:
        raise p.ProtocolError("'lora_name' needs to be provided to unload a LoRA adapter.",
                              param="lora_name")
    m = _lora_manager(state)
    try:
        digest = m.unregister(name)
    except KeyError:
        raise p.ProtocolError(f"The lora adapter '{name}' cannot be found.", status=404,
                              param="lora_name", code="lora_not_found") from None
    while state.engine.uses_adapter(digest):
        await asyncio.sleep(_UNLOAD_POLL_S)
    log.info("LoRA adapter %r unloaded", name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def openapi_for_lora(spec: dict, state: ServerState) -> dict:
    """The spec with the adapters' names allowed in `model` and, when runtime updating is
    on, the load and unload routes."""
    names = [a["id"] for a in cards(state)]
    if names:
        spec = _allow_names(spec, state.model, names)
    if manager(state) is not None and runtime_updating_allowed():
        body = lambda *fields: {"type": "object", "required": list(fields), "properties": {
            f: {"type": "string", "minLength": 1} for f in fields}}
        spec["paths"]["/v1/load_lora_adapter"] = _post_text(
            "serve a PEFT LoRA folder under a name", body("lora_name", "lora_path"))
        spec["paths"]["/v1/unload_lora_adapter"] = _post_text(
            "stop serving an adapter (waits for its running requests)", body("lora_name"))
    return spec


def _post_text(summary: str, body: dict) -> dict:
    error = {"description": "error", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"post": {"summary": summary, "requestBody": {
        "required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "OK", "content": {"text/plain": {
            "schema": {"type": "string"}}}}, **{s: error for s in
                                                ("400", "401", "404", "413", "503")}}}}


def _allow_names(node, model: str, names: list[str]):
    if isinstance(node, dict):
        if node.get("const") == model and len(node) == 1:
            return {"enum": [model, *names]}
        return {k: _allow_names(v, model, names) for k, v in node.items()}
    if isinstance(node, list):
        return [_allow_names(v, model, names) for v in node]
    return node
