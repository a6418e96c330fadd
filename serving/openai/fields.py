"""Typed access to the fields of an OpenAI request body, and the error every refusal is.

Strict about types: a bool is not an int, NaN and infinities are rejected, a string is never
coerced. A ProtocolError carries the HTTP status and OpenAI's error envelope.
"""
from __future__ import annotations

import math


_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 422: "invalid_request_error",
                   429: "rate_limit_error", 500: "server_error",
                   503: "service_unavailable_error"}


class ProtocolError(Exception):
    """A request the server answers with an error; `to_dict()` is OpenAI's envelope."""

    def __init__(self, message: str, *, status: int = 400, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# -- typed field access --------------------------------------------------------------------

def is_int(x) -> bool:
    """An integer as JSON Schema counts them: 3 and 3.0, never true or 3.5."""
    return (isinstance(x, int) and not isinstance(x, bool)) or (
        isinstance(x, float) and x.is_integer())


def token_id_list(value) -> list[int] | None:
    """A list of token ids (non-negative integers) as ints, or None if it is not one."""
    if isinstance(value, list) and all(is_int(t) and t >= 0 for t in value):
        return [int(t) for t in value]
    return None


def bad(param: str, rule: str, value) -> ProtocolError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return ProtocolError(f"'{param}' must be {rule}, got {shown}", param=param)


def int_field(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
        raise bad(name, "an integer" + bounds, value)
    return int(value)


def number_field(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        raise bad(name, "a finite number", value)
    return float(value)


def _optional(body: dict, name: str, kind: type, rule: str, default):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise bad(name, rule, value)
    return value


def opt_bool(body: dict, name: str, default: bool = False) -> bool:
    return _optional(body, name, bool, "a boolean", default)


def opt_str(body: dict, name: str, default=None):
    return _optional(body, name, str, "a string", default)


def unsupported(param: str, what: str) -> ProtocolError:
    return ProtocolError(f"{what} is not supported by this server", param=param,
                         code="unsupported_parameter")
