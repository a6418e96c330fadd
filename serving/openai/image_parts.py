"""Image parts of a request, read and checked: chat's `image_url` part (`{"type":
"image_url", "image_url": {"url": ..., "detail": ...}}`, or the URL as a plain string) and
the Responses API's `input_image` (`{"type": "input_image", "image_url": "..."}`).

The models served today take text only: a well-formed image part is refused with a 400 that
says so, a malformed one with a 400 naming what is wrong. Pure Python: no aiohttp, no JAX.
"""
from __future__ import annotations

from serving.openai.fields import ProtocolError

IMAGE_PARTS = ("image_url", "input_image")
DETAILS = ("auto", "low", "high", "original")


def image_url(part: dict, where: str, param: str) -> str:
    """The URL of an image part (its `type` one of IMAGE_PARTS), checked."""
    value = part.get("image_url")
    if part["type"] == "image_url" and isinstance(value, dict):
        detail = value.get("detail", "auto")
        if detail not in DETAILS:
            raise ProtocolError(f"{where}.image_url.detail must be one of {', '.join(DETAILS)}",
                                param=param)
        value = value.get("url")
    elif part["type"] == "input_image" and part.get("file_id") is not None:
        raise ProtocolError(f"{where}.file_id: this server keeps no files; send the image as "
                            "image_url (a data: or http(s) URL)", param=param,
                            code="unsupported_parameter")
    if not (isinstance(value, str) and value):
        raise ProtocolError(f"{where}: an image part needs its URL (image_url, or "
                            "image_url.url), a data: or http(s) URL", param=param)
    return value


def refuse_images(where: str, param: str) -> ProtocolError:
    """The answer to an image part for a model without a vision encoder."""
    return ProtocolError(f"{where}: an image part, but the model served takes text only "
                         "(image input needs a vision-language model)", param=param,
                         code="unsupported_parameter")
