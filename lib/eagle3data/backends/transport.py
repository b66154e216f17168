"""A lean HTTP/1.1 keep-alive transport for `httpx.AsyncClient` at thousands of requests in flight.

httpx's default transport (httpcore's pool on anyio) rescans every pooled connection several
times per request, which costs O(n^2) CPU at 2,000 connections, and spends most of a
millisecond per request in layers a JSON POST does not need. This transport keeps a free
list of idle connections per origin (O(1) to take or return one), speaks HTTP/1.1 through
`h11` over asyncio streams, and reads whole bodies. Timeouts are the caller's: the engine
wraps every request in `asyncio.timeout`. A connection is reused only after a complete
exchange; anything cut midway closes it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict

import h11
import httpx

_READ = 65536


class _Stale(Exception):
    """A kept-alive connection the server had already closed: nothing of a response came back."""


class _Conn:
    __slots__ = ("reader", "writer", "h11")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 with keep-alive: one connection per request in flight, idle ones kept for reuse."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None):
        self._ssl = ssl_context or httpx.create_ssl_context()
        self._idle: dict[tuple[bytes, bytes, int], list[_Conn]] = defaultdict(list)

    async def _connect(self, url: httpx.URL) -> _Conn:
        https = url.scheme == "https"
        port = url.port or (443 if https else 80)
        try:
            reader, writer = await asyncio.open_connection(
                url.host, port, ssl=self._ssl if https else None, server_hostname=url.host if https else None,
                limit=_READ * 4)
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {url.host}:{port}: {e}") from None
        return _Conn(reader, writer)

    async def _exchange(self, conn: _Conn, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                        body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        h = conn.h11
        conn.writer.write(h.send(h11.Request(method=method, target=target, headers=headers))
                          + (h.send(h11.Data(data=body)) if body else b"") + h.send(h11.EndOfMessage()))
        status, resp_headers, chunks = 0, [], []
        while True:
            ev = h.next_event()
            if ev is h11.NEED_DATA:
                data = await conn.reader.read(_READ)
                if not data and status == 0 and h.their_state is h11.SEND_RESPONSE:
                    raise _Stale()
                h.receive_data(data)
                continue
            if isinstance(ev, h11.Response):
                status, resp_headers = ev.status_code, ev.headers
            elif isinstance(ev, h11.Data):
                chunks.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                return status, list(resp_headers), chunks[0] if len(chunks) == 1 else b"".join(chunks)
            elif isinstance(ev, h11.ConnectionClosed):
                raise httpx.RemoteProtocolError("server closed the connection without a response")

    async def send(self, url: httpx.URL, method: bytes, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One exchange on a pooled connection: (status, lower-cased headers, body).

        The engine's hot path: no `httpx.Request`/`Response` objects, no URL merging, cookie
        jar or auth/redirect flow (about half of the CPU of a request through
        `AsyncClient.post` at 2,000 in flight). `headers` must be complete (host,
        content-length, ...); bodies are returned as sent (ask for `accept-encoding: identity`).
        Errors are httpx's (`ConnectError`, `RemoteProtocolError`), as through the client.
        """
        key = (url.raw_scheme, url.raw_host, url.port or 0)
        target = url.raw_path
        idle = self._idle[key]
        for attempt in (0, 1):
            reused = bool(idle) and attempt == 0
            conn = idle.pop() if reused else await self._connect(url)
            if reused and conn.reader.at_eof():
                conn.close()
                conn = await self._connect(url)
                reused = False
            try:
                result = await self._exchange(conn, method, target, headers, body)
            except (_Stale, ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                if reused:
                    continue  # once more on a fresh connection
                raise httpx.RemoteProtocolError(f"connection closed without a response ({type(e).__name__})") from None
            except (h11.RemoteProtocolError, ConnectionError) as e:
                conn.close()
                raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}") from None
            except BaseException:
                conn.close()
                raise
            if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
                conn.h11.start_next_cycle()
                idle.append(conn)
            else:
                conn.close()
            return result
        raise httpx.RemoteProtocolError("no response")  # pragma: no cover

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        status, headers, content = await self.send(request.url, request.method.encode(), list(request.headers.raw),
                                                   body)
        return httpx.Response(status, headers=headers, content=content, request=request,
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
