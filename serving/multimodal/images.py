"""Image bytes -> a decoded RGB image and its content hash, off the event loop.

Pillow decodes (the image processors of transformers take PIL images, so what we decode is
what the oracle reads). The header is read first and the pixel count checked against the
cap before the pixels are decoded, so a small file claiming a huge canvas (a decompression
bomb) costs nothing. Decoding runs in a thread pool: a large PNG takes tens of milliseconds,
which the event loop serving every stream cannot spend. The hash is of the bytes as sent:
two requests with the same image share encoder output and prefix-cache pages, two with
different images never do.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from PIL import Image

from serving.multimodal.media import MediaError, MediaPolicy, load_media

DEFAULT_MAX_PIXELS = 8192 * 8192


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB
    digest: str  # sha256 of the bytes sent, hex

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size  # (width, height)


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> DecodedImage:
    """-> the image in RGB, or a 422 for bytes that are not an image Pillow reads, or one
    over max_pixels."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(f"the image is {width}x{height}, over the {max_pixels} "
                                 "pixels this server decodes", 422)
            image = image.convert("RGB")  # decodes; a palette or alpha made plain RGB
    except MediaError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as e:
        raise MediaError(f"the image could not be decoded: {e}", 422) from None
    return DecodedImage(image, hashlib.sha256(data).hexdigest())


class ImageLoader:
    """Fetches (media.py) and decodes images for the server, decoding in a small pool."""

    def __init__(self, policy: MediaPolicy, max_pixels: int = DEFAULT_MAX_PIXELS,
                 threads: int = 2):
        self.policy = policy
        self.max_pixels = max_pixels
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="xlaserve-image")

    async def load(self, url: str) -> DecodedImage:
        data = await load_media(url, self.policy)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, decode_image, data, self.max_pixels)

    async def load_all(self, urls: list[str]) -> list[DecodedImage]:
        """Every image of a request, fetched at once; the first failure is the answer."""
        return list(await asyncio.gather(*(self.load(u) for u in urls)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
