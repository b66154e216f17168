"""One HTTP/2 connection (RFC 9113) carrying many requests at once, for `transport.LeanTransport`.

The protocol (framing, HPACK, flow control, stream states) is the `h2` library's; this module only
drives it over an asyncio TLS stream: one reader task turns the server's frames into per-stream
results, `request` sends one stream and waits for its answer. Why HTTP/2 at all: 2,000 requests in
flight over HTTP/1.1 need 2,000 TLS handshakes before the run reaches full speed; over HTTP/2 they
need `ceil(2000 / max_concurrent_streams)` (8 at the 256 streams public servers allow).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import httpx

_READ = 65536
_WINDOW = 2**24  # per stream: a whole response body without a WINDOW_UPDATE round trip
_CONN_WINDOW = 2**30
STREAMS_PER_CONNECTION = 100
"""Our own cap on a connection's streams, below the server's when it allows more: `h2` counts a
connection's open streams by walking all of them on every new stream, so 1,000 streams on one
connection spent a fifth of the client's CPU there; 100 per connection (RFC 9113's recommended
minimum for servers) costs a few more handshakes and a tenth of that walk."""
_HOP = frozenset((b"host", b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"te"))


class Refused(Exception):
    """The server never processed this stream (GOAWAY past it, or REFUSED_STREAM): safe to send again."""


class _Stream:
    __slots__ = ("done", "status", "headers", "chunks", "window")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.done: asyncio.Future = loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.window: asyncio.Event | None = None  # set while a request body waits for flow-control credit


class H2Conn:
    """An HTTP/2 client connection; `capacity` is the server's MAX_CONCURRENT_STREAMS once `ready`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, authority: bytes):
        self.reader, self.writer, self.authority = reader, writer, authority
        cfg = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                        normalize_outbound_headers=False, validate_inbound_headers=False)
        self.h2 = h2.connection.H2Connection(cfg)
        self.h2.initiate_connection()
        self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,
                                 h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self.h2.increment_flow_control_window(_CONN_WINDOW - 65535)
        writer.write(self.h2.data_to_send())
        loop = asyncio.get_running_loop()
        self.streams: dict[int, _Stream] = {}
        self.ready: asyncio.Future = loop.create_future()  # the server's first SETTINGS arrived
        self.error: Exception | None = None  # the connection is gone (or going away): no new streams
        self._loop = loop
        self._reader_task = loop.create_task(self._read())
        self._on = {h2.events.ResponseReceived: self._response, h2.events.DataReceived: self._data,
                    h2.events.StreamEnded: self._ended, h2.events.StreamReset: self._reset,
                    h2.events.WindowUpdated: self._window, h2.events.RemoteSettingsChanged: self._settings,
                    h2.events.ConnectionTerminated: self._goaway}

    @property
    def capacity(self) -> int:
        return min(STREAMS_PER_CONNECTION, self.h2.remote_settings.max_concurrent_streams)

    def usable(self) -> bool:
        return self.error is None

    def has_room(self) -> bool:
        return self.error is None and len(self.streams) < self.capacity

    # -- frames from the server -------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                data = await self.reader.read(_READ)
                if not data:
                    self._fail(httpx.RemoteProtocolError("the server closed the HTTP/2 connection"))
                    return
                for ev in self.h2.receive_data(data):
                    handler = self._on.get(type(ev))
                    if handler is not None:
                        handler(ev)
                out = self.h2.data_to_send()
                if out:
                    self.writer.write(out)
        except h2.exceptions.ProtocolError as e:
            self._fail(httpx.RemoteProtocolError(f"HTTP/2 protocol error from the server: {e}"))
        except (OSError, ConnectionError) as e:
            self._fail(httpx.RemoteProtocolError(f"HTTP/2 connection lost: {type(e).__name__}: {e}"))
        except asyncio.CancelledError:
            self._fail(httpx.RemoteProtocolError("HTTP/2 connection closed"))
            raise

    def _response(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is None:
            return
        for k, v in ev.headers:
            if k == b":status":
                st.status = int(v)
            elif not k.startswith(b":"):
                st.headers.append((k, v))

    def _data(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None:
            st.chunks.append(ev.data)
        self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)

    def _ended(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None and not st.done.done():
            body = st.chunks[0] if len(st.chunks) == 1 else b"".join(st.chunks)
            st.done.set_result((st.status, st.headers, body))

    def _reset(self, ev: Any) -> None:
        st = self.streams.get(ev.stream_id)
        if st is not None and not st.done.done():
            if ev.error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
                st.done.set_exception(Refused())
            else:
                st.done.set_exception(httpx.RemoteProtocolError(
                    f"the server reset the HTTP/2 stream ({h2.errors.ErrorCodes(ev.error_code).name})"))

    def _window(self, ev: Any) -> None:
        for st in self.streams.values() if ev.stream_id == 0 else [self.streams.get(ev.stream_id)]:
            if st is not None and st.window is not None:
                st.window.set()

    def _settings(self, ev: Any) -> None:
        if not self.ready.done():
            self.ready.set_result(None)

    def _goaway(self, ev: Any) -> None:
        """GOAWAY: streams above `last_stream_id` were never processed (sent again elsewhere); the rest finish."""
        self.error = httpx.RemoteProtocolError(f"the server is closing the HTTP/2 connection (GOAWAY "
                                               f"{h2.errors.ErrorCodes(ev.error_code).name})")
        last = ev.last_stream_id if ev.last_stream_id is not None else 0
        for sid, st in self.streams.items():
            if sid > last and not st.done.done():
                st.done.set_exception(Refused())
        if not self.ready.done():
            self.ready.set_exception(Refused())

    def _fail(self, exc: Exception) -> None:
        self.error = self.error or exc
        for st in self.streams.values():
            if not st.done.done():
                st.done.set_exception(exc)
            if st.window is not None:
                st.window.set()
        if not self.ready.done():
            self.ready.set_exception(exc)
        self.close()

    # -- requests -------------------------------------------------------------------------
    async def request(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One stream: (status, lower-cased headers, body); `headers` named in lower case, as HTTP/2 requires.
        `Refused` when the server never took it."""
        if self.error is not None:
            raise Refused()
        h = self.h2
        sid = h.get_next_available_stream_id()
        st = self.streams[sid] = _Stream(self._loop)
        try:
            hdrs = [(b":method", method), (b":scheme", b"https"), (b":authority", self.authority),
                    (b":path", target)] + [(k, v) for k, v in headers if k not in _HOP]
            h.send_headers(sid, hdrs, end_stream=not body)
            view = memoryview(body)
            while view:
                n = min(h.local_flow_control_window(sid), h.max_outbound_frame_size, len(view))
                if n <= 0:
                    self.writer.write(h.data_to_send())
                    st.window = asyncio.Event()
                    await st.window.wait()
                    st.window = None
                    if self.error is not None:
                        raise self.error
                    continue
                h.send_data(sid, view[:n].tobytes(), end_stream=n == len(view))
                view = view[n:]
            self.writer.write(h.data_to_send())
            return await st.done
        except h2.exceptions.TooManyStreamsError:
            raise Refused() from None
        except BaseException:
            if self.error is None and sid in h.streams and not h.streams[sid].closed:
                try:  # cancelled (the engine's timeout) or failed: tell the server to drop the stream
                    h.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                    self.writer.write(h.data_to_send())
                except (h2.exceptions.ProtocolError, OSError, RuntimeError):
                    pass
            raise
        finally:
            del self.streams[sid]
            if self.error is not None and not self.streams:
                self.close()

    def close(self) -> None:
        if self.error is None:
            self.error = httpx.RemoteProtocolError("HTTP/2 connection closed")
        if not self._reader_task.done() and asyncio.current_task() is not self._reader_task:
            self._reader_task.cancel()
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass
