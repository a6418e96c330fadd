"""A streaming request read event by event (http.client undoes the chunked encoding), for
tests that act while streams are under way."""
from __future__ import annotations

import http.client
import json

HANG_S = 120  # no read may wait longer: a stream that stalls this long counts as a hang


class Stream:
    """Sends the request at once; waits for the answer's head only when first read."""

    def __init__(self, port: int, path: str, body: dict, headers: dict | None = None):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
        self.conn.request("POST", path, json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json", **(headers or {})})
        self._response: http.client.HTTPResponse | None = None
        self.events: list[dict] = []  # what has been read so far, without [DONE]
        self.done = False

    @property
    def response(self) -> http.client.HTTPResponse:
        if self._response is None:
            self._response = self.conn.getresponse()
        return self._response

    @property
    def status(self) -> int:
        return self.response.status

    def error_body(self) -> dict:
        """The JSON answer of a stream refused before it started (status != 200)."""
        assert self.status != 200
        return json.loads(self.response.read())

    def next(self) -> dict | None:
        """The next event, or None after [DONE]."""
        assert self.status == 200 and not self.done
        line = self.response.readline()
        assert line.startswith(b"data: "), line
        assert self.response.readline() == b"\n"
        data = line[len(b"data: "):].strip()
        if data == b"[DONE]":
            self.done = True
            assert self.response.read() == b""
            return None
        self.events.append(json.loads(data))
        return self.events[-1]

    def read(self, n: int) -> list[dict]:
        for _ in range(n):
            assert self.next() is not None
        return self.events

    def rest(self) -> list[dict]:
        while not self.done:
            self.next()
        return self.events

    def close(self) -> None:
        self.conn.close()


def text(events: list[dict]) -> str:
    """A completions stream's text."""
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
