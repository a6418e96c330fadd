"""The producer's side channel: a decode instance claims an offer before pulling it and
releases it after, one TCP connection per transfer, one line each way:

    decode -> prefill   "claim <transfer_id>\\n"
    prefill -> decode   "ok\\n" (the offer is alive and now the caller's) or "gone\\n"
    decode -> prefill   "done\\n", then closes

The prefill instance frees the pages when that connection ends, however it ends (done, the
decode side gone, or silent for the offer timeout). Claiming first answers at once what a
pull cannot: `jax.experimental.transfer` waits, without a working timeout, for an offer that
expired or a producer that died; a refused or dead side channel sends the request to a local
prefill instead. Plain sockets, threads, no JAX.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import threading

log = logging.getLogger("xlaserve")


class SideChannelServer:
    """claim(transfer_id) -> bool runs on the connection's thread and must be thread-safe;
    release(transfer_id) likewise, once per successful claim."""

    def __init__(self, host: str, port: int, claim, release, timeout_s: float):
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = timeout_s

            def handle(self):
                outer._handle(self.rfile, self.wfile)

        self._claim, self._release = claim, release
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="xlaserve-kv-side-channel",
                         daemon=True).start()

    def _handle(self, rfile, wfile) -> None:
        try:
            word, _, arg = rfile.readline(64).decode().strip().partition(" ")
            transfer_id = int(arg) if word == "claim" and arg.isdigit() else None
        except (OSError, ValueError):
            return
        if transfer_id is None or not self._claim(transfer_id):
            _write(wfile, b"gone\n")
            return
        try:
            if _write(wfile, b"ok\n"):
                rfile.readline(64)  # "done", EOF or the timeout: the transfer is over
        except OSError:
            pass
        finally:
            self._release(transfer_id)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _write(wfile, data: bytes) -> bool:
    try:
        wfile.write(data)
        wfile.flush()
        return True
    except OSError:
        return False


def claim(host: str, port: int, transfer_id: int, timeout_s: float) -> socket.socket:
    """Claims an offer; the returned socket stays open until `release`. Raises OSError when
    the producer is unreachable, LookupError when it no longer has the offer."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.sendall(f"claim {transfer_id}\n".encode())
        reply = sock.makefile("rb").readline(64).strip()
    except OSError:
        sock.close()
        raise
    if reply != b"ok":
        sock.close()
        raise LookupError(f"the prefill instance no longer offers transfer {transfer_id}")
    return sock


def release(sock: socket.socket) -> None:
    try:
        sock.sendall(b"done\n")
    except OSError:
        pass  # the producer frees on the closed connection all the same
    finally:
        sock.close()
