"""Loopback HTTP servers on 127.0.0.1 speaking SGLang `/generate`, vLLM `/v1/completions` and OpenRouter
`/chat/completions`.

A raw asyncio HTTP/1.1 server (keep-alive, Content-Length bodies), cheap enough to answer
thousands of requests per second on one core, so that it is never the bottleneck of the
client under test. Responses wait a fixed `latency` (+ uniform `jitter`) on a timer, not a
task. Faults are switchable per request: push names onto `server.faults` (consumed one per
generation request) or set `server.always` to a fault name.

Faults: `429` (with Retry-After), `402`, `401`, `500`, `slow` (answers after `slow_s`),
`malformed` (200 with a body that is not JSON), `truncated` (Content-Length larger than
what is sent, then close), `eot` (content already holds the end-of-turn text), `error200`
(HTTP 200 with finish_reason "error"). A model mismatch is `LoopbackServer(model_path=...)`.
vLLM only: `abort` (finish_reason "abort"), `prompt_changed` (prompt_token_ids differ from the
prompt sent), `no_token_ids` (a server without return_token_ids: choices carry text only).
vLLM with `hidden_states=fn` (ids -> [n, 4, H] tensor) and `hidden_dir`: each completion writes
`<hidden_dir>/<id>.safetensors` (`hidden_states`, `token_ids`) under an exclusive flock on its `.lock`,
as vLLM's hidden-states connector does, and names it in `kv_transfer_params.hidden_states_path`.
Faults: `hs_lost` (the path is named, nothing is written), `hs_locked` (the lock is taken and never
released), `die` (the server closes its socket and every connection, answering nothing: a dead server).
OpenRouter only: a request with `logprobs: true` gets `choices[0].logprobs` in the OpenAI shape
(`content`: one `{token, logprob, bytes, top_logprobs}` per token, `refusal`: null; by default
one entry per word of the content); `server.chat_script` (request -> dict) can set the answer's
`reasoning`, `content`, `finish_reason`, `prompt_tokens` (billed), `completion_tokens`,
`reasoning_tokens` and `logprobs`.

TLS: `LoopbackServer(..., ssl_context=ctx)` (or `--tls-cert/--tls-key`); `http2=True` (`--http2`)
offers HTTP/2 (through the `h2` library) beside HTTP/1.1 by ALPN, as public HTTPS servers do: each
connection speaks what its client chose. `h2_max_streams` (`--h2-max-streams`) is the
MAX_CONCURRENT_STREAMS it allows per connection (256 by default, as large CDNs). HTTP/2 only:
`goaway` (the server sends GOAWAY refusing this stream and every later one on the connection,
answering the earlier ones: the client must send the refused ones again on a new connection); `truncated` resets the stream midway.

Use in tests: `with LoopbackServer("openai") as srv: srv.base_url ...`. As a process (for the
bench): `python tests/loopback.py --kind openai --latency 4 --port 0` prints `PORT <n>`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from collections import deque
from typing import Any

import orjson

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 404: "Not Found",
           408: "Request Timeout", 429: "Too Many Requests", 500: "Internal Server Error"}
WORDS = ("the value of x is computed first then we check each case and compare the result with the "
         "expected bound so the answer follows directly from the definition").split()


def _text(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    n = 0
    while n < nbytes:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def _word_logprobs(text: str, top: int | None) -> list[dict[str, Any]]:
    """Per-token entries for `text`, one per word with its leading space (the way BPE vocabularies hold words)."""
    out, i = [], 0
    while i < len(text):
        j = text.find(" ", i + 1)
        j = len(text) if j < 0 else j
        piece = text[i:j]
        ent: dict[str, Any] = {"token": piece, "logprob": -0.25, "bytes": list(piece.encode())}
        ent["top_logprobs"] = [{"token": piece, "logprob": -0.25, "bytes": list(piece.encode())}][: top or 0]
        out.append(ent)
        i = j
    return out


class _Conn(asyncio.Protocol):
    def __init__(self, server: "LoopbackServer"):
        self.server = server
        self.buf = b""
        self.t: asyncio.Transport | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.t = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport  # type: ignore[assignment]
        self.server.transports.add(transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = self.buf[:i].decode("latin-1").split("\r\n")
            n = 0
            for line in head[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    n = int(v.strip())
            if len(self.buf) < i + 4 + n:
                return
            body = self.buf[i + 4: i + 4 + n]
            self.buf = self.buf[i + 4 + n:]
            parts = head[0].split(" ", 2)
            if len(parts) != 3 or not parts[2].startswith("HTTP/1"):  # not HTTP/1.x (e.g. an HTTP/2 preface)
                self.t.close()
                return
            method, path, _ = parts
            self.server._handle(self, method, path.split("?", 1)[0], body)

    def send(self, status: int, body: bytes, headers: dict[str, str] | None = None, truncate: bool = False) -> None:
        t = self.t
        if t is None or t.is_closing():
            return
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{extra}\r\n").encode()
        if truncate:
            t.write(head + body[: len(body) // 2])
            t.close()
        else:
            t.write(head + body)


class _H2Stream:
    """What `_handle` answers through for one HTTP/2 stream (the same `send` as an HTTP/1.1 connection)."""

    def __init__(self, conn: "_H2Conn", stream_id: int):
        self.conn, self.stream_id = conn, stream_id

    def send(self, status: int, body: bytes, headers: dict[str, str] | None = None, truncate: bool = False) -> None:
        self.conn.respond(self.stream_id, status, body, headers or {}, truncate)


class _AlpnConn(asyncio.Protocol):
    """One TLS connection that speaks what its client chose by ALPN: HTTP/2 or HTTP/1.1."""

    def __init__(self, server: "LoopbackServer"):
        self.server = server
        self.impl: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = transport.get_extra_info("ssl_object")
        h2 = tls is not None and tls.selected_alpn_protocol() == "h2"
        self.impl = _H2Conn(self.server) if h2 else _Conn(self.server)
        self.server.connections[("h2" if h2 else "http/1.1")] += 1
        self.impl.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.impl.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.impl.connection_lost(exc)


class _H2Conn(asyncio.Protocol):
    """HTTP/2 (RFC 9113, through `h2`) over one TLS connection: many streams, flow control honoured."""

    def __init__(self, server: "LoopbackServer"):
        import h2.config
        import h2.connection

        self.server = server
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        self.t: asyncio.Transport | None = None
        self.streams: dict[int, tuple[dict[str, str], bytearray]] = {}
        self.pending: dict[int, tuple[memoryview, bool]] = {}
        self.goaway_last: int | None = None  # after a graceful GOAWAY: the last stream still processed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        from h2.settings import SettingCodes

        self.t = transport  # type: ignore[assignment]
        self.h2.initiate_connection()
        self.h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: self.server.h2_max_streams,
                                 SettingCodes.INITIAL_WINDOW_SIZE: 2**24})
        self.h2.increment_flow_control_window(2**30 - 65535)
        self.t.write(self.h2.data_to_send())

    def connection_lost(self, exc: Exception | None) -> None:
        self.t = None

    def data_received(self, data: bytes) -> None:
        import h2.events
        import h2.exceptions

        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            if self.t is not None:
                self.t.close()
            return
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                self.streams[ev.stream_id] = (dict(ev.headers), bytearray())
            elif isinstance(ev, h2.events.DataReceived):
                if ev.stream_id in self.streams:
                    self.streams[ev.stream_id][1].extend(ev.data)
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id in self.streams:
                head, body = self.streams.pop(ev.stream_id)
                if self.goaway_last is not None and ev.stream_id > self.goaway_last:
                    continue  # refused by the GOAWAY: never processed
                self.server._handle(_H2Stream(self, ev.stream_id), head[":method"], head[":path"].split("?", 1)[0],
                                    bytes(body))
            elif isinstance(ev, h2.events.WindowUpdated):
                self._flush()
            elif isinstance(ev, h2.events.StreamReset):
                self.pending.pop(ev.stream_id, None)
            elif isinstance(ev, h2.events.ConnectionTerminated) and self.t is not None:
                self.t.close()
        if self.t is not None:
            self.t.write(self.h2.data_to_send())

    def goaway(self, sid: int) -> None:
        """Refuse stream `sid` and every later one (GOAWAY naming the stream before it as the last processed);
        earlier streams are still answered and the connection stays open, as a server shutting down
        gracefully does. The frame is written by hand: `h2`'s `close_connection` closes its state machine,
        after which it can answer no stream and errors on the client's next frame (the server then closed
        the socket with the client's data unread, and the reset could overtake the GOAWAY)."""
        from hyperframe.frame import GoAwayFrame

        if self.t is None or self.t.is_closing():
            return
        self.goaway_last = max(0, sid - 2)
        frame = GoAwayFrame(0)
        frame.last_stream_id = self.goaway_last
        self.t.write(self.h2.data_to_send() + frame.serialize())

    def respond(self, sid: int, status: int, body: bytes, headers: dict[str, str], truncate: bool) -> None:
        import h2.exceptions

        if self.t is None or self.t.is_closing() or (self.goaway_last is not None and sid > self.goaway_last):
            return
        hdrs = [(":status", str(status)), ("content-type", "application/json"), ("content-length", str(len(body)))]
        try:
            self.h2.send_headers(sid, hdrs + list(headers.items()))
        except h2.exceptions.StreamClosedError:
            return
        self.pending[sid] = (memoryview(body[: len(body) // 2] if truncate else body), truncate)
        self._flush()

    def _flush(self) -> None:
        from h2.errors import ErrorCodes

        for sid, (data, cut) in list(self.pending.items()):
            while data:
                n = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size, len(data))
                if n <= 0:
                    break
                self.h2.send_data(sid, bytes(data[:n]))
                data = data[n:]
            if data:
                self.pending[sid] = (data, cut)
                continue
            del self.pending[sid]
            if cut:
                self.h2.reset_stream(sid, ErrorCodes.INTERNAL_ERROR)
            else:
                self.h2.end_stream(sid)
        if self.t is not None:
            self.t.write(self.h2.data_to_send())


class LoopbackServer:
    """An SGLang-like (`kind="sglang"`), vLLM-like (`kind="vllm"`) or OpenRouter-like (`kind="openai"`) server
    on a thread. `id_prefix` starts every SGLang/vLLM response id (tells workers apart behind a router)."""

    def __init__(self, kind: str = "openai", *, latency: float = 0.0, jitter: float = 0.0, slow_s: float = 5.0,
                 model_path: str = "HuggingFaceTB/SmolLM2-135M-Instruct", credit: float | None = 100.0,
                 price_per_token: float = 1e-6, body_bytes: tuple[int, int] = (200, 600), retry_after: str = "1",
                 eot_id: int = 2, eot_text: str = "<|im_end|>", record: bool = True, seed: int = 0,
                 api_key: str | None = None, id_prefix: str = "rid", served_model_name: str | None = None,
                 ssl_context: Any = None, http2: bool = False, h2_max_streams: int = 256,
                 context_len: int | None = None, bill_words: bool = False):
        assert kind in ("openai", "sglang", "vllm")
        self.bill_prompt: Any = None  # OpenRouter kind: request -> billed prompt tokens (e.g. the templated prompt's)
        self.bill_words = bill_words  # OpenRouter kind: bill one token per word (WORDS are one token each in BPE vocabularies)
        self.context_len = context_len  # SGLang kind: the model's context length (None: no limit)
        self.id_prefix = id_prefix
        self.served_model_name = served_model_name or model_path
        self.ssl_context = ssl_context
        self.http2 = http2
        self.h2_max_streams = h2_max_streams
        self.connections: dict[str, int] = {"h2": 0, "http/1.1": 0}  # TLS connections by the protocol chosen
        self.kind = kind
        self.latency = latency
        self.jitter = jitter
        self.slow_s = slow_s
        self.model_path = model_path
        self.credit = credit
        self.spent = 0.0
        self.price = price_per_token
        self.body_bytes = body_bytes
        self.retry_after = retry_after
        self.eot_id = eot_id
        self.eot_text = eot_text
        self.record = record
        self.api_key = api_key
        self.rng = random.Random(seed)
        self.faults: deque[str] = deque()
        self.script: Any = None  # SGLang kind: prompt ids -> output ids, instead of the generated ones
        # OpenRouter kind: request -> {"reasoning", "content", "logprobs", "usage"...} overriding the generated answer
        self.chat_script: Any = None
        self.always: str | None = None
        self.requests: list[dict[str, Any]] = []
        self.probes: list[float] = []  # when GET /v1/models was answered (vLLM kind)
        self.served = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._bodies: list[bytes] | None = None
        self.hidden_states: Any = None  # vLLM kind: ids -> [n, 4, H] states written as the connector does
        self.hidden_dir: Any = None
        self.held_locks: list[int] = []  # `hs_locked`: descriptors holding a lock never released
        self.transports: set[Any] = set()

    @property
    def base_url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}" + {"openai": "/api/v1", "vllm": "/v1"}.get(self.kind, "")

    # -- lifecycle ---------------------------------------------------------------------------
    async def serve(self, port: int = 0) -> None:
        """Start listening on the running loop (used by the thread and by the CLI)."""
        self._loop = asyncio.get_running_loop()
        if self.ssl_context is not None:
            self.ssl_context.set_alpn_protocols(["h2", "http/1.1"] if self.http2 else ["http/1.1"])
        proto = (lambda: _AlpnConn(self)) if self.ssl_context is not None else (lambda: _Conn(self))
        self._server = await self._loop.create_server(proto, "127.0.0.1", port, backlog=8192, ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]

    def start(self) -> "LoopbackServer":
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.serve())
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"loopback-{self.kind}", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> "LoopbackServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- handling ----------------------------------------------------------------------------
    def _delay(self) -> float:
        return self.latency + (self.rng.uniform(0, self.jitter) if self.jitter else 0.0)

    def _later(self, delay: float, fn: Any, *args: Any) -> None:
        if delay <= 0:
            fn(*args)
        else:
            self._loop.call_later(delay, fn, *args)

    def _handle(self, conn: _Conn, method: str, path: str, body: bytes) -> None:
        if path.startswith("/api/v1"):
            path = path[len("/api/v1"):]
        elif self.kind == "vllm" and path != "/health":  # vLLM serves its OpenAI API under /v1 only
            if not path.startswith("/v1/"):
                return conn.send(404, b'{"detail":"Not Found"}')
            path = path[len("/v1"):]
        if self.kind == "vllm" and path == "/models":
            self.probes.append(time.monotonic())
            return conn.send(200, orjson.dumps({"object": "list", "data": [
                {"id": self.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                 "root": self.model_path, "parent": None, "max_model_len": 8192}]}))
        if path == "/health":
            return conn.send(200, b"")
        if path == "/get_model_info":
            return conn.send(200, orjson.dumps({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                                "is_generation": True}))
        if path == "/key":
            rem = None if self.credit is None else round(self.credit - self.spent, 6)
            return conn.send(200, orjson.dumps({"data": {"label": "loopback", "limit": self.credit,
                                                         "usage": self.spent, "limit_remaining": rem}}))
        if path not in ("/generate", "/chat/completions", "/completions"):
            return conn.send(404, b'{"error":{"code":404,"message":"no such path"}}')
        fault = self.faults.popleft() if self.faults else self.always
        req = None
        if self.record or self._bodies is None:
            try:
                req = orjson.loads(body)
            except orjson.JSONDecodeError:
                if self.kind == "sglang":  # SGLang's own shape (tests/test_sglang_engine.py checks it on the real one)
                    return conn.send(400, orjson.dumps({"object": "error", "message": (
                        "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', 1), 'msg': 'JSON decode "
                        "error', 'input': {}}\n\n  POST /generate"), "type": "BadRequestError", "param": None,
                        "code": 400}))
                return conn.send(400, b'{"error":{"code":400,"message":"bad json"}}')
        if self.record:
            self.requests.append({"t": time.monotonic(), "path": path, "fault": fault, "body": req})
        if fault == "429":
            return conn.send(429, b'{"error":{"code":429,"message":"rate limited"}}', {"retry-after": self.retry_after})
        if fault == "402":
            return conn.send(402, b'{"error":{"code":402,"message":"Insufficient credits"}}')
        if fault == "401":
            return conn.send(401, b'{"error":{"code":401,"message":"No auth credentials found"}}')
        if fault == "404":  # what OpenRouter answers when routing leaves no endpoint
            return conn.send(404, b'{"error":{"code":404,"message":"No endpoints found matching your provider '
                                  b'preferences"}}')
        if fault == "500":
            return self._later(self._delay(), conn.send, 500, b'{"error":{"code":500,"message":"upstream failed"}}')
        if fault == "slow":
            return self._later(self.slow_s, conn.send, 200, self._answer(req, None))
        if fault == "goaway" and isinstance(conn, _H2Stream):
            return conn.conn.goaway(conn.stream_id)
        if fault == "malformed":
            return self._later(self._delay(), conn.send, 200, b'{"choices": [{"message": {"content": "ab')
        if fault == "die":  # stops listening and drops every connection: nothing is answered from now on
            self._server.close()
            for t in list(self.transports):
                t.abort()
            return
        refused = self._sglang_refusal(req) if self.kind == "sglang" and req is not None else None
        if refused is not None:
            return conn.send(400, orjson.dumps({"error": {"message": refused}}))
        self.served += 1
        out = self._answer(req, fault)
        self._later(self._delay(), conn.send, 200, out, None, fault == "truncated")

    def _answer(self, req: dict[str, Any] | None, fault: str | None) -> bytes:
        if self.kind == "sglang":
            return self._sglang(req)
        if self.kind == "vllm":
            return self._vllm(req, fault)
        if self._bodies is not None and fault is None:
            body = self._bodies[self.served % len(self._bodies)]
            self.spent += 0.0005
            return body
        return self._openai(req, fault)

    def _sglang_refusal(self, req: dict[str, Any]) -> str | None:
        """SGLang's 400 message for a request it refuses (real messages, 0.5.23), or None."""
        ids = req.get("input_ids")
        if ids is None and req.get("text") is None:
            return "Either text, input_ids or input_embeds should be provided."
        if ids == []:
            return "input_ids cannot be empty."
        max_new = int((req.get("sampling_params") or {}).get("max_new_tokens", 128))
        for p in (ids if ids and isinstance(ids[0], list) else [ids or []]):
            if self.context_len is not None and len(p) >= self.context_len:
                return (f"The input ({len(p)} tokens) is longer than the model's context length "
                        f"({self.context_len} tokens).")
            if self.context_len is not None and len(p) + max_new > self.context_len:
                return (f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                        f"tokens. You requested a total of {len(p) + max_new} tokens: {len(p)} tokens from the input "
                        f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in "
                        "the input messages or the completion to fit within the limit.")
        return None

    def _sglang(self, req: dict[str, Any]) -> bytes:
        ids = req["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        sp = req.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 16))
        stops = set(sp.get("stop_token_ids") or []) | {self.eot_id}
        out = []
        for p in ids if batch else [ids]:
            n = 3 + (len(p) + sum(p[-3:])) % 13  # deterministic per prompt
            body = [100 + (len(p) * 7 + i * 31) % 4000 for i in range(n)] + [self.eot_id]
            if self.script is not None:  # a test's own output ids for this prompt
                body = list(self.script(p))
            hit = next((i for i, t in enumerate(body[:max_new]) if t in stops), None)
            if hit is not None:  # as SGLang: the stop id ends the output and stays in output_ids
                body, fr = body[:hit + 1], {"type": "stop", "matched": body[hit]}
            else:
                body, fr = body[:max_new], {"type": "length", "length": max_new}
            out.append({"text": "", "output_ids": body,
                        "meta_info": {"id": f"{self.id_prefix}-{self.rng.getrandbits(48):x}", "finish_reason": fr,
                                      "prompt_tokens": len(p), "completion_tokens": len(body), "cached_tokens": 0,
                                      "e2e_latency": float(self.latency)}})
        return orjson.dumps(out if batch else out[0])

    def _vllm(self, req: dict[str, Any], fault: str | None) -> bytes:
        """A `/v1/completions` answer as vLLM gives it for token-id prompts with `return_token_ids`."""
        ids = req["prompt"]
        batch = bool(ids) and isinstance(ids[0], list)
        max_new = int(req.get("max_tokens") or 16)
        stops = set(req.get("stop_token_ids") or [])
        choices, pt, ct = [], 0, 0
        for i, p in enumerate(ids if batch else [ids]):
            n = 3 + (len(p) + sum(p[-3:])) % 13  # deterministic per prompt (as the SGLang-like server)
            body = [100 + (len(p) * 7 + k * 31) % 4000 for k in range(n)] + [self.eot_id]
            if len(body) > max_new:
                body, fr, why = body[:max_new], "length", None
            else:
                fr, why = "stop", (self.eot_id if self.eot_id in stops else None)
            if fault == "abort":
                fr, why = "abort", None
            choice: dict[str, Any] = {"index": i, "text": " ".join(f"t{t}" for t in body), "logprobs": None,
                                      "finish_reason": fr, "stop_reason": why}
            if req.get("return_token_ids") and fault != "no_token_ids":
                choice["token_ids"] = body
                choice["prompt_token_ids"] = list(p) + ([0] if fault == "prompt_changed" else [])
            choices.append(choice)
            pt, ct = pt + len(p), ct + len(body)
        rid = f"{self.id_prefix}-cmpl-{self.rng.getrandbits(48):x}"
        answer = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.get("model"),
                  "choices": choices, "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
                                                "prompt_tokens_details": None}}
        if self.hidden_states is not None:
            answer["kv_transfer_params"] = {"hidden_states_path": self._write_states(rid, ids, fault)}
        return orjson.dumps(answer)

    def _write_states(self, rid: str, ids: list[int], fault: str | None) -> str:
        """Write one request's states as vLLM's connector does (file under an exclusive flock); its path."""
        import fcntl
        import os

        import torch
        from safetensors.torch import save_file

        path = str(self.hidden_dir / f"{rid}.safetensors")
        if fault == "hs_lost":
            return path
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if fault == "hs_locked":
            self.held_locks.append(fd)
            return path
        try:
            save_file({"hidden_states": self.hidden_states(ids).contiguous(),
                       "token_ids": torch.tensor(ids, dtype=torch.long)}, path)
        finally:
            os.close(fd)
        return path

    def _openai(self, req: dict[str, Any] | None, fault: str | None) -> bytes:
        lo, hi = self.body_bytes
        size = self.rng.randint(lo, hi)
        reasoning = _text(self.rng, size * 2 // 3)
        content = _text(self.rng, size // 3)
        if fault == "eot":
            content += self.eot_text
        scripted = self.chat_script(req or {}) if self.chat_script is not None else {}
        reasoning, content = scripted.get("reasoning", reasoning), scripted.get("content", content)
        msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning": reasoning}
        finish = scripted.get("finish_reason", "stop")
        tools = (req or {}).get("tools")
        if tools:
            name = tools[0]["function"]["name"]
            msg["tool_calls"] = [{"id": f"call_{self.rng.getrandbits(32):x}", "type": "function",
                                  "function": {"name": name, "arguments": "{}"}}]
            finish = "tool_calls"
        prompt_chars = sum(len(m.get("content") or "") for m in (req or {}).get("messages", []))
        pt, rt, ct = prompt_chars // 4 + 8, len(reasoning or "") // 4, (len(reasoning or "") + len(content or "")) // 4
        if self.bill_words:
            rt = len((reasoning or "").split())
            ct = rt + len((content or "").split())
        if self.bill_prompt is not None and req:
            pt = self.bill_prompt(req)
        cost = round((pt + ct) * self.price, 8)
        self.spent += cost
        pt, ct = scripted.get("prompt_tokens", pt), scripted.get("completion_tokens", ct)
        rt = scripted.get("reasoning_tokens", rt)
        choice: dict[str, Any] = {"index": 0, "message": msg, "finish_reason": finish, "native_finish_reason": finish}
        if (req or {}).get("logprobs"):  # OpenAI shape: per content token {token, logprob, bytes, top_logprobs}
            choice["logprobs"] = scripted.get("logprobs") or {"content": _word_logprobs(content or "",
                                                                                          (req or {}).get("top_logprobs")),
                                                              "refusal": None}
        if fault == "error200":
            choice.update(finish_reason="error", native_finish_reason="error",
                          error={"code": 502, "message": "provider disconnected mid-stream"})
        return orjson.dumps({
            "id": f"gen-{self.rng.getrandbits(64):x}", "provider": "Loopback-int4", "model": (req or {}).get("model"),
            "object": "chat.completion", "created": int(time.time()), "choices": [choice],
            "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
                      "completion_tokens_details": {"reasoning_tokens": rt},
                      "prompt_tokens_details": {"cached_tokens": 0}, "cost": cost}})

    def prebuild(self, n: int = 64) -> None:
        """Answer from `n` prepared bodies (no request parsing): the cheapest server, for benchmarks."""
        self._bodies = [self._openai({"messages": [{"role": "user", "content": "x" * 200}]}, None) for _ in range(n)]
        self.record = False


def _prompt_biller(profile: str, tokenizer_dir: str) -> Any:
    """request -> its prompt's token count, templated as the client templates it (eagle3data's own rule)."""
    from transformers import AutoTokenizer

    from eagle3data.core.profiles import get_profile
    from eagle3data.prompts.load import Prompt, template_prompt

    tok, prof = AutoTokenizer.from_pretrained(tokenizer_dir), get_profile(profile)
    return lambda req: len(template_prompt(tok, Prompt("api", 0, req.get("messages") or [], req.get("tools")), prof))


def main() -> None:
    ap = argparse.ArgumentParser(description="loopback SGLang/OpenRouter server")
    ap.add_argument("--kind", default="openai", choices=["openai", "sglang", "vllm"])
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--jitter", type=float, default=0.0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--body-min", type=int, default=1024)
    ap.add_argument("--body-max", type=int, default=8192)
    ap.add_argument("--id-prefix", default="rid", help="start of every SGLang/vLLM response id")
    ap.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM) ...")
    ap.add_argument("--tls-key", help="... and this key")
    ap.add_argument("--http2", action="store_true", help="offer HTTP/2 beside HTTP/1.1 over TLS (ALPN)")
    ap.add_argument("--h2-max-streams", type=int, default=256, help="HTTP/2 MAX_CONCURRENT_STREAMS per connection")
    ap.add_argument("--fresh", action="store_true", help="openai: a new random answer per request (no prepared bodies)")
    ap.add_argument("--bill-words", action="store_true", help="openai: bill one completion token per word")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bill-prompt-with", nargs=2, metavar=("PROFILE", "TOKENIZER_DIR"),
                    help="openai: bill the prompt tokens of the messages and tools templated as this profile does")
    args = ap.parse_args()
    ctx = None
    if args.tls_cert:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    elif args.http2:
        raise SystemExit("--http2 needs --tls-cert/--tls-key (clients negotiate h2 through TLS ALPN)")
    srv = LoopbackServer(args.kind, latency=args.latency, jitter=args.jitter, body_bytes=(args.body_min, args.body_max),
                         record=False, credit=None, id_prefix=args.id_prefix, model_path=args.model_path,
                         ssl_context=ctx, http2=args.http2, h2_max_streams=args.h2_max_streams,
                         bill_words=args.bill_words, seed=args.seed)
    if args.bill_prompt_with:
        srv.bill_prompt = _prompt_biller(*args.bill_prompt_with)
    if args.kind == "openai" and not args.fresh:
        srv.prebuild()

    async def run() -> None:
        await srv.serve(args.port)
        print(f"PORT {srv.port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
