"""An image part's URL -> its bytes, under the server's media policy.

Three schemes, as vLLM takes them:
- `data:` URLs, base64 only (`data:image/png;base64,...`): always.
- `file://` paths: only under `--allowed-local-media-path DIR`, the path resolved first (so
  `..` and symlinks cannot leave the folder).
- `http://` and `https://`: fetched by the server with a bounded size, time and number of
  redirects. `--allowed-media-domains` limits the hosts, checked on every hop; hosts that
  resolve to private, loopback, link-local, shared (CGNAT) or reserved addresses are
  refused unless `allow_private` (a server reaching into its own network for a client is
  the classic request forgery). The addresses are checked by the resolver the connection
  itself uses, so a name cannot resolve one way when checked and another when connected.

Refusals by policy (a scheme or host the server does not allow, a malformed URL) are 400s;
media that cannot be fetched (the origin's error, a timeout, too large) are 422s, vLLM's
"Failed to fetch media from URL". Pure Python and aiohttp: no JAX.
"""
from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver

PARAM = "image_url"
_CGNAT = ipaddress.ip_network("100.64.0.0/10")


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_path: Path | None = None  # file:// under this folder only; None: refused
    allowed_domains: tuple[str, ...] = ()  # http(s) hosts allowed; empty: any public host
    allow_private: bool = False  # hosts on private, loopback or link-local addresses
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    max_redirects: int = 5


class MediaError(ValueError):
    """An image the server will not or cannot load: status 400 (refused by policy or
    malformed) or 422 (unfetchable or undecodable), for the HTTP layer's error."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message, self.status, self.param = message, status, PARAM


def refused(message: str) -> MediaError:
    return MediaError(message, 400)


def unfetchable(url: str, why: str) -> MediaError:
    return MediaError(f"Failed to fetch media from URL: {_short(url)}: {why}", 422)


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."


async def load_media(url: str, policy: MediaPolicy) -> bytes:
    """The bytes `url` names, or a MediaError (400: refused; 422: unfetchable)."""
    if not isinstance(url, str) or not url:
        raise refused("image_url must be a non-empty string URL")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, policy)
    if scheme == "file":
        return _local_file(url, policy)
    if scheme in ("http", "https"):
        return await _fetch(url, policy)
    raise refused(f"unsupported image URL scheme {scheme or url[:16]!r}: use data:, http(s):"
                  " or file: (under --allowed-local-media-path)")


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise refused("a data: URL needs a comma before its payload")
    if not head.lower().endswith(";base64"):
        raise refused("only base64 data URLs are supported (data:<type>;base64,...)")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise unfetchable(url, f"larger than {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise unfetchable(url, "the data URL is not valid base64") from None


def _local_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise refused("cannot load local files without --allowed-local-media-path")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise refused(f"file: URLs name a local path, not a host ({parts.netloc!r})")
    root = policy.allowed_local_path.resolve()
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise refused(f"{unquote(parts.path)} is not under --allowed-local-media-path")
    try:
        if path.stat().st_size > policy.max_bytes:
            raise unfetchable(url, f"larger than {policy.max_bytes} bytes")
        return path.read_bytes()
    except OSError as e:
        raise unfetchable(url, e.strerror or type(e).__name__) from None


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                or ip.is_reserved or ip.is_unspecified
                or (ip.version == 4 and ip in _CGNAT))


class PrivateHost(OSError):
    """A name whose every address is private or local."""


class _PublicResolver(AbstractResolver):
    """aiohttp's resolver, keeping only public addresses: the ones the connection uses."""

    def __init__(self):
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host, port=0, family=socket.AF_INET):
        found = await self._inner.resolve(host, port, family)
        public = [a for a in found if is_public(a["host"])]
        if not public:
            raise PrivateHost(f"the host {host} resolves to a private or local address")
        return public

    async def close(self):
        await self._inner.close()


def _check_host(url: str, policy: MediaPolicy) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise refused(f"cannot fetch {_short(url)}: an http(s) URL with a host is needed")
    host = parts.hostname.lower()
    if policy.allowed_domains and host not in policy.allowed_domains:
        raise refused(f"the host {host} is not in --allowed-media-domains")
    if not policy.allow_private and _is_address(host) and not is_public(host):
        raise refused(f"the host {host} is a private or local address")
    # a name: the resolver the connection uses checks its addresses


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    connector = aiohttp.TCPConnector(
        resolver=None if policy.allow_private else _PublicResolver())
    timeout = aiohttp.ClientTimeout(total=policy.timeout_s)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for _ in range(policy.max_redirects + 1):
                _check_host(url, policy)
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                        url = urljoin(url, resp.headers["Location"])
                        continue
                    if resp.status >= 400:
                        raise unfetchable(url, f"HTTP {resp.status}")
                    return await _read_bounded(resp, url, policy.max_bytes)
            raise unfetchable(url, f"more than {policy.max_redirects} redirects")
    except TimeoutError:
        raise unfetchable(url, f"no answer within {policy.timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError) as e:
        cause = getattr(e, "os_error", None)
        if isinstance(cause, PrivateHost):
            raise refused(str(cause)) from None
        raise unfetchable(url, str(e) or type(e).__name__) from None


async def _read_bounded(resp, url: str, limit: int) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise unfetchable(url, f"larger than {limit} bytes")
    data = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > limit:
            raise unfetchable(url, f"larger than {limit} bytes")
    return bytes(data)
