"""What a request's prompt becomes before the engine sees it: the model it names checked, the
chat template rendered and tokenized, the choices of one prompt, a forced tool call's
constraint. Shared by the chat, completions and Responses routes. Pure Python: no JAX."""
from __future__ import annotations

import dataclasses
import json

from serving.core.structured_outputs import StructuredOutputsParams
from serving.openai import protocol as p
from serving.openai import responses
from serving.openai import sse
from serving.openai.server_state import ServerState, check_prompt_size


# -- request helpers -----------------------------------------------------------------------

def check_model(state: ServerState, model: str | None):
    """-> the LoRARequest of the adapter `model` names, or None for the base model; an
    unknown name is a 404."""
    if model is None or model == state.model:
        return None
    manager = getattr(state.engine, "lora", None)
    adapter = manager.named.get(model) if manager is not None else None
    if adapter is None:
        raise p.ProtocolError(f"The model '{model}' does not exist; this server serves "
                              f"'{state.model}'.", status=404, param="model",
                              code="model_not_found")
    return adapter


def served_name(state: ServerState, lora) -> str:
    """The `model` a response reports: the adapter asked for, else the served model."""
    return state.model if lora is None else lora.lora_name


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_ids(state: ServerState, messages: list[dict], add_generation_prompt: bool,
              add_special_tokens: bool = False, tools: list[dict] | None = None,
              template_kwargs: dict | None = None) -> list[int]:
    return chat_prompt(state, messages, add_generation_prompt, add_special_tokens, tools,
                        template_kwargs)[1]


def chat_prompt(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                 add_special_tokens: bool = False, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """(the rendered prompt, its token ids). template_kwargs: chat_template_kwargs."""
    size = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
    check_prompt_size(state, size, "messages")
    tokenizer = state.engine.tokenizer
    template = state.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise p.ProtocolError("this model has no chat template; use /v1/completions",
                              param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None,
                                             chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - templates raise for bad conversations
        raise p.ProtocolError(f"the chat template rejected the messages: {e}",
                              param="messages") from None
    # The template already writes BOS and friends where the model wants them.
    return text, encode(tokenizer, text, add_special_tokens)


def prompt_choices(prompt_ids: list[int], prompt_index: int, params, first_index: int,
             prompt_text: str = "", lora=None, **echo) -> list[sse.Choice]:
    """The n choices of one prompt: one engine request whose samples they are. echo:
    sse.Choice's echo_only, echo_logprobs and prompt_logprobs. lora: check_model's."""
    request_id = responses.new_id("req")
    return [sse.Choice(first_index + i, request_id, prompt_ids, params, prompt_index,
                       prompt_text, sample_index=i, lora=lora, **echo)
            for i in range(params.n)]


def forced_tool_call(params, tools):
    """tool_choice "required" or a named function: the output must follow the tools' JSON
    schema (serving/openai/tools.py), through structured outputs."""
    if params.structured_outputs is not None:
        raise p.ProtocolError("a forced tool_choice cannot be combined with response_format "
                              "or structured outputs", param="tool_choice")
    return dataclasses.replace(params,
                               structured_outputs=StructuredOutputsParams(json=tools.schema()))
