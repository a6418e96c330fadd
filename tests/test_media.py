"""Image URLs under the media policy (serving/multimodal/): data URLs, local files under
the allowed folder only, http(s) fetched with bounded size, time and redirects, the domain
list checked on every hop, private and loopback hosts refused unless allowed; decoding
with a pixel cap; refusals 400 and unfetchable media 422, in OpenAI's error shape."""
import asyncio
import base64
import hashlib
import io

import pytest
from aiohttp import web
from PIL import Image

from serving.multimodal.images import ImageLoader, decode_image
from serving.multimodal.media import MediaError, MediaPolicy, is_public, load_media
from serving.openai.fields import ProtocolError


def _png(size=(5, 3), mode="RGBA") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, (10, 200, 30, 128)[:len(mode)]).save(out, "PNG")
    return out.getvalue()


PNG = _png()
OPEN = MediaPolicy(allow_private=True, max_bytes=4096, timeout_s=2.0, max_redirects=3)


def _run(coro):
    return asyncio.run(coro)


def _error(coro) -> MediaError:
    with pytest.raises(MediaError) as info:
        _run(coro)
    assert info.value.param == "image_url" and info.value.status in (400, 422)
    return info.value


def test_data_urls():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert _run(load_media(url, MediaPolicy())) == PNG
    assert _error(load_media("data:image/png,rawbytes", MediaPolicy())).status == 400
    assert _error(load_media("data:image/png;base64,%%%", MediaPolicy())).status == 422
    big = "data:image/png;base64," + base64.b64encode(bytes(5000)).decode()
    assert "larger than" in _error(load_media(big, OPEN)).message
    assert _error(load_media("ftp://host/a.png", MediaPolicy())).status == 400


def test_local_files(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    url = f"file://{root}/a.png"
    refused = _error(load_media(url, MediaPolicy()))
    assert refused.status == 400 and "--allowed-local-media-path" in refused.message
    policy = MediaPolicy(allowed_local_path=root)
    assert _run(load_media(url, policy)) == PNG
    for escape in (f"file://{root}/../secret.png", f"file://{root}/link.png"):
        assert _error(load_media(escape, policy)).status == 400
    assert _error(load_media(f"file://{root}/missing.png", policy)).status == 422
    assert _error(load_media(f"file://otherhost{root}/a.png", policy)).status == 400


def test_public_addresses():
    for private in ("10.1.2.3", "172.16.0.1", "192.168.1.1", "127.0.0.1", "169.254.169.254",
                    "100.64.0.1", "0.0.0.0", "::1", "fe80::1", "::ffff:127.0.0.1", "fc00::1"):
        assert not is_public(private), private
    for public in ("8.8.8.8", "1.1.1.1", "2606:4700::1111"):
        assert is_public(public), public


async def _site(handlers):
    app = web.Application()
    for path, handler in handlers.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def _handlers(port_box):
    async def image(_):
        return web.Response(body=PNG, content_type="image/png")

    async def chunked(_):
        resp = web.StreamResponse()
        await resp.prepare(_)
        for _i in range(10):
            await resp.write(bytes(1000))
        return resp

    async def slow(_):
        await asyncio.sleep(5)
        return web.Response(body=PNG)

    def to(path):
        async def handler(_):
            raise web.HTTPFound(path() if callable(path) else path)
        return handler
    async def big(_):
        return web.Response(body=bytes(5000))

    async def missing(_):
        return web.Response(status=404)
    return {"/img.png": image, "/chunked": chunked, "/slow": slow, "/big": big,
            "/missing": missing,
            "/hop": to("/img.png"), "/loop": to("/loop"),
            "/elsewhere": to(lambda: f"http://localhost:{port_box[0]}/img.png")}


def test_http_fetches_under_the_policy():
    async def go():
        box = [0]
        runner, port = await _site(_handlers(box))
        box[0] = port
        base = f"http://127.0.0.1:{port}"
        try:
            assert await load_media(f"{base}/img.png", OPEN) == PNG
            assert await load_media(f"{base}/hop", OPEN) == PNG  # a redirect followed
            results = {}
            for name, url, policy in (
                    ("private", f"{base}/img.png", MediaPolicy()),
                    ("private name", f"http://localhost:{port}/img.png", MediaPolicy()),
                    ("domain", f"{base}/img.png", MediaPolicy(allow_private=True,
                                                              allowed_domains=("a.org",))),
                    ("hop off the list", f"{base}/elsewhere",
                     MediaPolicy(allow_private=True, allowed_domains=("127.0.0.1",))),
                    ("loop", f"{base}/loop", OPEN), ("404", f"{base}/missing", OPEN),
                    ("big", f"{base}/big", OPEN), ("chunked big", f"{base}/chunked", OPEN),
                    ("slow", f"{base}/slow", MediaPolicy(allow_private=True, timeout_s=0.3))):
                try:
                    await load_media(url, policy)
                    results[name] = None
                except MediaError as e:
                    results[name] = (e.status, e.message)
            return results
        finally:
            await runner.cleanup()
    results = _run(go())
    for name in ("private", "private name", "domain", "hop off the list"):
        assert results[name][0] == 400, (name, results[name])
    assert "allowed-media-domains" in results["hop off the list"][1]
    for name in ("loop", "404", "big", "chunked big", "slow"):
        assert results[name][0] == 422, (name, results[name])
        assert results[name][1].startswith("Failed to fetch media from URL"), results[name]
    assert "HTTP 404" in results["404"][1] and "redirects" in results["loop"][1]


def test_decoding():
    image = decode_image(PNG)
    assert image.size == (5, 3) and image.image.mode == "RGB"
    assert image.digest == hashlib.sha256(PNG).hexdigest()
    assert image.image.getpixel((0, 0)) == (10, 200, 30)
    with pytest.raises(MediaError) as info:
        decode_image(b"not an image")
    assert info.value.status == 422
    with pytest.raises(MediaError) as info:
        decode_image(_png((300, 200), "RGB"), max_pixels=300 * 199)
    assert info.value.status == 422 and "300x200" in info.value.message


def test_loader_fetches_and_decodes_every_image():
    other = _png((2, 2), "RGB")
    urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in (PNG, other)]
    loader = ImageLoader(MediaPolicy())
    try:
        images = _run(loader.load_all(urls))
        assert [i.size for i in images] == [(5, 3), (2, 2)]
        assert images[0].digest != images[1].digest
        assert _error(loader.load_all([urls[0], "data:image/png;base64,AAAA"])).status == 422
    finally:
        loader.close()


def test_image_parts_are_read_then_refused_for_a_text_model():
    """The models served take text only: a well-formed image part gets a 400 saying so, a
    malformed one a 400 naming what is wrong (chat and Responses)."""
    from serving.openai.protocol import parse_chat_request
    from serving.openai.response_items import to_messages
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()

    def chat(part, role="user"):
        with pytest.raises(ProtocolError) as info:
            parse_chat_request({"model": "m", "messages": [{"role": role, "content": [
                {"type": "text", "text": "what is this?"}, part]}]})
        assert (info.value.status, info.value.param) == (400, "messages")
        return info.value.message

    for part in ({"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                 {"type": "image_url", "image_url": url}):
        assert "takes text only" in chat(part)
    assert "detail" in chat({"type": "image_url", "image_url": {"url": url, "detail": "x"}})
    assert "needs its URL" in chat({"type": "image_url", "image_url": {}})
    assert "only user messages" in chat({"type": "image_url", "image_url": url}, "system")

    def responses(part):
        with pytest.raises(ProtocolError) as info:
            to_messages([{"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "what is this?"}, part]}], set())
        assert (info.value.status, info.value.param) == (400, "input")
        return info.value.message

    assert "takes text only" in responses({"type": "input_image", "image_url": url,
                                           "detail": "auto"})
    assert "keeps no files" in responses({"type": "input_image", "file_id": "file-1"})
