"""The JSON-object options vLLM takes on its command line (--speculative-config,
--kv-events-config, --kv-transfer-config, --pooler-config): JSON text or a dict, checked
against the keys the option knows, with errors that name the option. Plain Python."""
from __future__ import annotations

import json


def json_object(value: str | dict, name: str, known, ignored=()) -> dict:
    """value as a dict of known keys (those in `ignored` dropped); ValueError naming `name`
    for text that is not JSON, JSON that is not an object, or a key it does not know."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(known) - set(ignored))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return {k: v for k, v in value.items() if k not in ignored}
