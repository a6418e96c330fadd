"""vLLM's `chat_template_kwargs`: extra keyword arguments for the chat template (for example
`{"enable_thinking": false}` for Qwen3), checked before they reach it. Pure Python."""
from __future__ import annotations

from serving.openai.fields import ProtocolError

# What the server itself passes to, or controls in, tokenizer.apply_chat_template: a request
# may not override them through the template's keyword arguments.
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs"})


def chat_template_kwargs(body: dict) -> dict:
    """The request's template keyword arguments ({} when absent)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError("'chat_template_kwargs' must be an object",
                            param="chat_template_kwargs")
    for key in value:  # JSON keys: always strings
        if key in RESERVED:
            raise ProtocolError(f"'chat_template_kwargs' may not set {key!r}: the server "
                                "sets it", param="chat_template_kwargs")
    return value


OPENAPI = {
    "chat_template_kwargs": {
        "anyOf": [{"type": "null"}, {"type": "object", "propertyNames": {
            "not": {"enum": sorted(RESERVED)}}}],
        "description": "keyword arguments for the chat template, e.g. "
                       "{\"enable_thinking\": false}; the server's own are refused"},
    "include_reasoning": {
        "type": ["boolean", "null"],
        "description": "with --reasoning-parser: false drops the thinking from the response"},
}
