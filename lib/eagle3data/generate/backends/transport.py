"""The engine's HTTP transport for thousands of requests in flight: HTTP/2 over TLS where the server
offers it, HTTP/1.1 keep-alive otherwise.

httpx's default transport (httpcore's pool on anyio) rescans every pooled connection several
times per request, which costs O(n^2) CPU at 2,000 connections, spends most of a millisecond per
request in layers a JSON POST does not need, and over HTTP/2 sends past the server's stream
limit instead of opening another connection. Here, per origin: HTTP/2 connections
(`h2conn.H2Conn`, the `h2` library's protocol) each carry up to the server's
MAX_CONCURRENT_STREAMS requests, and a new one is opened only when all are full (requests that
come meanwhile wait for it); for HTTP/1.1 a free list of idle connections (O(1) to take or
return one) speaks through `h11`. The protocol is the server's choice by ALPN. Connection
opening is capped (`MAX_CONNECTING`), so each new connection carries its request as soon as it is
up. Timeouts are the caller's: the engine wraps every request in `asyncio.timeout`. An HTTP/1.1
connection is reused only after a complete exchange; anything cut midway closes it. A stream the
server never processed (GOAWAY, REFUSED_STREAM) is sent again on another connection.
"""
from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict

import h11
import httpx

from eagle3data.generate.backends.h2conn import H2Conn, Refused

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


MAX_CONNECTING = 64
"""Connections being opened at once. Handshakes that all start together interleave and all finish
late: 2,000 TLS handshakes begun at once answered their first request after ~10 s on one core, where
64 at a time lets each connection carry its request as soon as it is up (bench/bench_generate.py)."""

_Key = tuple[bytes, bytes, int]


def _origin(url: httpx.URL) -> _Key:
    """The pool key of a URL: scheme, host, port."""
    return (url.raw_scheme, url.raw_host, url.port or 0)


class _Opening:
    """An HTTP/2 connection being opened for an origin, and how many requests are waiting for it: up to
    the streams the origin's server last allowed, or all of them for its first connection (its SETTINGS
    tell how many streams a connection takes before more are opened)."""

    __slots__ = ("task", "claims", "expect")

    def __init__(self, task: asyncio.Task, expect: int):
        self.task, self.claims, self.expect = task, 0, expect


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/2 where the server offers it over TLS (many requests per connection), else HTTP/1.1 with
    keep-alive (one connection per request in flight, idle ones kept for reuse)."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None, max_connecting: int = MAX_CONNECTING,
                 http2: bool = True):
        self._ssl = ssl_context or httpx.create_ssl_context()
        self._http2 = http2
        self._ssl.set_alpn_protocols(["h2", "http/1.1"] if http2 else ["http/1.1"])
        self._idle: dict[_Key, list[_Conn]] = defaultdict(list)
        self._h2: dict[_Key, list[H2Conn]] = defaultdict(list)
        self._opening: dict[_Key, list[_Opening]] = defaultdict(list)
        self._h1_only: set[_Key] = set()  # origins whose server chose HTTP/1.1
        self._streams: dict[_Key, int] = {}  # the last MAX_CONCURRENT_STREAMS an origin's server gave
        self._connecting = asyncio.Semaphore(max_connecting)

    async def _open(self, url: httpx.URL) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        https = url.scheme == "https"
        port = url.port or (443 if https else 80)
        async with self._connecting:
            try:
                return await asyncio.open_connection(
                    url.host, port, ssl=self._ssl if https else None, server_hostname=url.host if https else None,
                    limit=_READ * 4)
            except OSError as e:
                raise httpx.ConnectError(f"cannot connect to {url.host}:{port}: {e}") from None

    async def _connect(self, url: httpx.URL) -> _Conn:
        reader, writer = await self._open(url)
        return _Conn(reader, writer)

    async def _open_any(self, key: _Key, url: httpx.URL) -> None:
        """Open a connection to the origin: an HTTP/2 one joins the origin's pool once its server's
        SETTINGS arrived; an HTTP/1.1 one (the server chose it) goes to the idle list."""
        reader, writer = await self._open(url)
        tls = writer.get_extra_info("ssl_object")
        if tls is not None and tls.selected_alpn_protocol() == "h2":
            conn = H2Conn(reader, writer, url.netloc)
            try:
                await conn.ready
            except Refused:
                conn.close()
                raise httpx.RemoteProtocolError("the server closed the new HTTP/2 connection at once") from None
            except BaseException:
                conn.close()
                raise
            self._streams[key] = conn.capacity
            self._h2[key].append(conn)
        else:
            self._h1_only.add(key)
            self._idle[key].append(_Conn(reader, writer))

    def _may_h2(self, key: _Key, url: httpx.URL) -> bool:
        """HTTP/2 is tried: on, over TLS (ALPN), and the origin's server has not chosen HTTP/1.1."""
        return self._http2 and url.scheme == "https" and key not in self._h1_only

    def _h2_with_room(self, key: _Key) -> H2Conn | None:
        conns = self._h2.get(key)
        if not conns:
            return None
        for c in conns:
            if c.has_room():
                return c
        if any(not c.usable() for c in conns):
            conns[:] = [c for c in conns if c.usable()]
        return None

    async def _send_h2(self, key: _Key, url: httpx.URL, method: bytes, headers: list[tuple[bytes, bytes]],
                       body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """Over HTTP/2 when the origin speaks it (None when its server chose HTTP/1.1)."""
        refused = 0
        while key not in self._h1_only:
            conn = self._h2_with_room(key)
            if conn is not None:
                try:
                    return await conn.request(method, url.raw_path, headers, body)
                except Refused:
                    refused += 1
                    if refused > 3:
                        raise httpx.RemoteProtocolError("the server refused the HTTP/2 stream 4 times") from None
                    continue
            opening = self._opening[key]
            op = next((o for o in opening if o.claims < o.expect), None)
            if op is None:
                op = _Opening(asyncio.get_running_loop().create_task(self._open_any(key, url)),
                              self._streams.get(key, 1 << 30))
                op.task.add_done_callback(lambda t, o=op, lst=opening: lst.remove(o))
                opening.append(op)
            op.claims += 1
            try:
                await asyncio.shield(op.task)
            finally:
                op.claims -= 1
        return None

    async def warm(self, url: httpx.URL, in_flight: int) -> int:
        """Open, before the first wave, the HTTP/2 connections `in_flight` requests need (the first one
        tells the server's stream limit, the rest open together): a handshake that waits behind a
        dispatch loop busy sending the first wave delays every request queued for it. HTTP/1.1 origins
        (the server chose it, or HTTP/2 is off) are left to open as requests come: one connection per
        request either way. Returns the HTTP/2 connections open; connection errors are left to the
        requests, which retry and report them."""
        key = _origin(url)
        if not self._may_h2(key, url):
            return 0
        try:
            if not self._h2.get(key):
                await self._open_any(key, url)
            if key in self._h1_only:
                return 0
            per = self._streams.get(key) or 1
            missing = -(-in_flight // per) - len(self._h2[key])
            if missing > 0:
                await asyncio.gather(*(self._open_any(key, url) for _ in range(missing)))
        except (httpx.HTTPError, OSError):
            pass
        return len(self._h2.get(key, ()))

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
        content-length, ...) with lower-cased names (HTTP/2 refuses others); bodies are returned
        as sent (ask for `accept-encoding: identity`).
        Errors are httpx's (`ConnectError`, `RemoteProtocolError`), as through the client.
        """
        key = _origin(url)
        if self._may_h2(key, url):
            result = await self._send_h2(key, url, method, headers, body)
            if result is not None:
                return result
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
        status, headers, content = await self.send(request.url, request.method.encode(),
                                                   [(k.lower(), v) for k, v in request.headers.raw], body)
        return httpx.Response(status, headers=headers, content=content, request=request,
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        opening = [op.task for ops in self._opening.values() for op in ops]
        for t in opening:
            t.cancel()
        if opening:  # connections still being opened end here, not pending on a loop that outlives the client
            await asyncio.gather(*opening, return_exceptions=True)
        for h2s in self._h2.values():
            for h in h2s:
                h.close()
        self._h2.clear()
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
