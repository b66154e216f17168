"""The engine's hand-written HTTP/1.1 transport (backends/transport.py) against small servers on 127.0.0.1.

Keep-alive connections are reused; a server that closes an idle connection (before or while
the next request is sent) costs one fresh connection, not an error; a response cut midway
is an error and its connection is never reused; `Connection: close` is honoured; TLS works
with a trusted certificate and refuses an untrusted one.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess

import httpx
import pytest

from eagle3data.generate.backends.transport import LeanTransport


class Server:
    """A raw HTTP/1.1 server; `mode` says how it misbehaves. Counts connections and requests."""

    def __init__(self, mode: str = "ok", ssl_context: ssl.SSLContext | None = None):
        self.mode = mode
        self.ssl = ssl_context
        self.connections = 0
        self.requests = 0

    async def __aenter__(self) -> "Server":
        self.srv = await asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self.srv.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.srv.close()
        await self.srv.wait_closed()

    def url(self, path: str = "/x") -> httpx.URL:
        return httpx.URL(f"{'https' if self.ssl else 'http'}://127.0.0.1:{self.port}{path}")

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served_here = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                n = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(n)
                self.requests += 1
                served_here += 1
                if self.mode == "drop_second" and served_here == 2:
                    return  # read the request, close without a byte of answer (an idle-timeout race)
                out = b'{"ok": true, "echo": %d}' % len(body)
                if self.mode == "cut":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(out) + 100) + out)
                    await writer.drain()
                    return
                extra = b"connection: close\r\n" if self.mode in ("close_header", "close_after") else b""
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
                             % (len(out), extra) + out)
                await writer.drain()
                if self.mode == "close_header":
                    return
                if self.mode == "close_idle":  # keep-alive advertised, but the server drops idle connections
                    await asyncio.sleep(0.05)
                    return
        finally:
            writer.close()


def _headers(port: int, body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"127.0.0.1:%d" % port), (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body))]


async def _post(t: LeanTransport, srv: Server, body: bytes = b'{"a": 1}'):
    return await t.send(srv.url(), b"POST", _headers(srv.port, body), body)


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_connections_are_reused():
    async def main():
        async with Server() as srv:
            t = LeanTransport()
            for _ in range(5):
                status, headers, body = await _post(t, srv)
                assert status == 200 and body == b'{"ok": true, "echo": 8}'
                assert (b"content-type", b"application/json") in headers
            assert srv.connections == 1 and srv.requests == 5
            await asyncio.gather(*(_post(t, srv) for _ in range(4)))  # 4 at once: 3 more connections at most
            assert srv.connections == 4
            for _ in range(4):
                await _post(t, srv)
            assert srv.connections == 4 and srv.requests == 13
            await t.aclose()

    run(main())


@pytest.mark.parametrize("mode", ["close_idle", "drop_second"])
def test_server_closing_an_idle_connection_costs_a_fresh_one_not_an_error(mode):
    """close_idle: closed while idle (seen at EOF before reuse); drop_second: closed as the request arrives."""
    async def main():
        async with Server(mode) as srv:
            t = LeanTransport()
            assert (await _post(t, srv))[0] == 200
            await asyncio.sleep(0.15)
            assert (await _post(t, srv))[0] == 200
            assert srv.connections == 2
            await t.aclose()

    run(main())


def test_connection_close_header_is_honoured():
    async def main():
        async with Server("close_header") as srv:
            t = LeanTransport()
            for _ in range(3):
                assert (await _post(t, srv))[0] == 200
            assert srv.connections == 3 and not any(t._idle.values())
            await t.aclose()

    run(main())


def test_response_cut_midway_is_an_error_and_its_connection_is_dropped():
    async def main():
        async with Server("cut") as srv:
            t = LeanTransport()
            with pytest.raises(httpx.RemoteProtocolError):
                await _post(t, srv)
            assert not any(t._idle.values())  # never back in the pool
            srv.mode = "ok"
            assert (await _post(t, srv))[0] == 200 and srv.connections == 2
            await t.aclose()

    run(main())


def test_connect_refused_is_a_connect_error():
    async def main():
        async with Server() as srv:
            url = srv.url()
        with pytest.raises(httpx.ConnectError):
            await LeanTransport().send(url, b"POST", _headers(url.port, b"{}"), b"{}")

    run(main())


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the TLS test")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_tls_with_a_trusted_certificate_reuses_connections_and_refuses_an_untrusted_one(cert):
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(*cert)

    async def main():
        async with Server(ssl_context=server_ctx) as srv:
            t = LeanTransport(ssl.create_default_context(cafile=str(cert[0])))
            for _ in range(3):
                status, _, body = await _post(t, srv)
                assert status == 200 and body.startswith(b'{"ok": true')
            assert srv.connections == 1  # one handshake, then keep-alive over TLS
            await t.aclose()
            untrusted = LeanTransport(ssl.create_default_context())  # the system roots do not hold our cert
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
                await _post(untrusted, srv)

    run(main())


# -- HTTP/2 over TLS (the loopback server offers h2 and http/1.1 by ALPN, as public HTTPS servers do) ------

def _tls_pair(cert):
    from loopback import LoopbackServer

    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(*cert)
    return LoopbackServer, server_ctx, ssl.create_default_context(cafile=str(cert[0]))


_CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8}'


async def _chat(t: LeanTransport, srv) -> tuple[int, list, bytes]:
    url = httpx.URL(srv.base_url + "/chat/completions")
    return await t.send(url, b"POST", _headers(url.port, _CHAT) + [(b"authorization", b"Bearer k")], _CHAT)


def test_http2_multiplexes_requests_up_to_the_servers_stream_limit(cert):
    Loopback, server_ctx, client_ctx = _tls_pair(cert)
    with Loopback("openai", latency=0.2, ssl_context=server_ctx, http2=True, h2_max_streams=8) as srv:
        async def main():
            t = LeanTransport(client_ctx)
            answers = await asyncio.gather(*(_chat(t, srv) for _ in range(20)))
            assert {a[0] for a in answers} == {200}
            assert all(b'"choices"' in a[2] for a in answers)
            assert srv.connections == {"h2": 3, "http/1.1": 0}  # ceil(20 / 8): no connection per request
            for _ in range(5):
                assert (await _chat(t, srv))[0] == 200
            assert srv.connections["h2"] == 3  # later requests reuse them
            await t.aclose()

        run(main())
    assert len(srv.requests) == 25


def test_warm_opens_the_http2_connections_a_wave_needs_before_it_is_sent(cert):
    """The engine warms the transport before its first wave: ceil(in_flight / the server's stream limit) HTTP/2
    connections open, and the wave then opens none (its requests do not wait behind handshakes). A server that
    chooses HTTP/1.1, or one that cannot be reached, is left to the requests (0 warmed, nothing raised)."""
    Loopback, server_ctx, client_ctx = _tls_pair(cert)
    with Loopback("openai", latency=0.2, ssl_context=server_ctx, http2=True, h2_max_streams=8) as srv:
        async def main():
            t = LeanTransport(client_ctx)
            url = httpx.URL(srv.base_url + "/chat/completions")
            assert await t.warm(url, 20) == 3 and srv.connections == {"h2": 3, "http/1.1": 0}
            assert srv.requests == []  # warming sends no request
            answers = await asyncio.gather(*(_chat(t, srv) for _ in range(20)))
            assert {a[0] for a in answers} == {200} and srv.connections["h2"] == 3
            assert await t.warm(url, 20) == 3 and srv.connections["h2"] == 3  # warm again: nothing more to open
            await t.aclose()

        run(main())
    with Loopback("openai", ssl_context=server_ctx, http2=False) as srv:
        async def h1():
            t = LeanTransport(client_ctx)
            assert await t.warm(httpx.URL(srv.base_url + "/chat/completions"), 20) == 0
            assert (await _chat(t, srv))[0] == 200  # on the probe's connection, kept for it
            assert srv.connections == {"h2": 0, "http/1.1": 1}
            await t.aclose()

        run(h1())

    async def unreachable():
        t = LeanTransport(client_ctx)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        assert await t.warm(httpx.URL(f"https://127.0.0.1:{port}/v1/chat/completions"), 20) == 0
        await t.aclose()

    run(unreachable())


def test_http2_streams_refused_by_goaway_are_sent_again_on_a_new_connection(cert):
    Loopback, server_ctx, client_ctx = _tls_pair(cert)
    with Loopback("openai", latency=0.3, ssl_context=server_ctx, http2=True) as srv:
        async def main():
            t = LeanTransport(client_ctx)
            assert (await _chat(t, srv))[0] == 200  # the connection is up
            srv.faults.append("goaway")  # the next request: GOAWAY refusing it and every later stream
            answers = await asyncio.gather(*(_chat(t, srv) for _ in range(6)))
            assert [a[0] for a in answers] == [200] * 6
            assert srv.connections["h2"] == 2  # the refused streams went out again on one new connection
            await t.aclose()

        run(main())
    assert sum(r["fault"] == "goaway" for r in srv.requests) == 1


def test_http2_stream_reset_is_an_error_and_the_connection_carries_the_next_request(cert):
    Loopback, server_ctx, client_ctx = _tls_pair(cert)
    with Loopback("openai", ssl_context=server_ctx, http2=True) as srv:
        async def main():
            t = LeanTransport(client_ctx)
            srv.faults.append("truncated")  # half the body, then RST_STREAM
            with pytest.raises(httpx.RemoteProtocolError, match="reset the HTTP/2 stream"):
                await _chat(t, srv)
            assert (await _chat(t, srv))[0] == 200
            assert srv.connections["h2"] == 1
            await t.aclose()

        run(main())


def test_http2_a_request_cancelled_by_its_timeout_resets_only_its_stream(cert):
    Loopback, server_ctx, client_ctx = _tls_pair(cert)
    with Loopback("openai", ssl_context=server_ctx, http2=True, slow_s=3.0) as srv:
        async def main():
            t = LeanTransport(client_ctx)
            srv.faults.append("slow")
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):  # what the engine wraps every request in
                    await _chat(t, srv)
            assert (await _chat(t, srv))[0] == 200  # same connection, the cancelled stream is gone
            (conn,) = next(iter(t._h2.values()))
            assert conn.streams == {} and conn.usable()
            assert srv.connections["h2"] == 1
            await t.aclose()

        run(main())


def test_a_tls_server_that_chooses_http1_gets_keep_alive_http1(cert):
    Loopback, server_ctx, client_ctx = _tls_pair(cert)
    with Loopback("openai", ssl_context=server_ctx, http2=False) as srv:
        async def main():
            t = LeanTransport(client_ctx)
            for _ in range(3):
                assert (await _chat(t, srv))[0] == 200
            assert srv.connections == {"h2": 0, "http/1.1": 1}
            await t.aclose()

        run(main())


def test_http2_off_speaks_http1_to_a_server_that_offers_both(cert):
    Loopback, server_ctx, client_ctx = _tls_pair(cert)
    with Loopback("openai", ssl_context=server_ctx, http2=True) as srv:
        async def main():
            t = LeanTransport(client_ctx, http2=False)
            await asyncio.gather(*(_chat(t, srv) for _ in range(3)))
            assert srv.connections == {"h2": 0, "http/1.1": 3}
            await t.aclose()

        run(main())


@pytest.mark.parametrize("http2", [True, False])
def test_run_generate_over_https_sends_generation_requests_over_http2(cert, tmp_path, monkeypatch, http2):
    """The documented path end to end: 01's engine against an HTTPS OpenRouter-shaped server that offers h2
    and http/1.1 (the certificate trusted through SSL_CERT_FILE, as httpx reads it): every prompt journaled
    once, generation requests multiplexed over a few HTTP/2 connections, none over HTTP/1.1 but preflight's.
    With `generate.http2: false` the same run speaks HTTP/1.1 only (a connection per request in flight)."""
    import orjson

    from eagle3data.generate.run import run_generate
    from eagle3data.core.params import load_params
    from eagle3data.core.records import scan_journal

    from pathlib import Path

    Loopback, server_ctx, _ = _tls_pair(cert)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    monkeypatch.setenv("EAGLE3DATA_TEST_KEY", "sk-or-v1-loopback-not-a-real-key")
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"sample_id": i, "messages": [
        {"role": "user", "content": f"Frage {i}: wie viel ist {i} + {i}? 🙂"}]}) + b"\n" for i in range(40)))
    with Loopback("openai", latency=0.2, ssl_context=server_ctx, http2=True, h2_max_streams=8) as srv:
        params = load_params(Path(__file__).resolve().parents[1] / "params" / "ci.yaml", {
            "output_root": str(tmp_path / "out"), "run_name": "run", "datasets": [{"name": "d", "path": str(prompts)}],
            "generate.backend": "openai", "generate.concurrency": 40, "generate.timeout_s": 10, "generate.http2": http2,
            "generate.openai": {"base_url": srv.base_url, "model": "moonshotai/kimi-k2.5",
                                "api_key_env": "EAGLE3DATA_TEST_KEY", "reasoning": {"enabled": True}}})
        summary = run_generate(params, progress=False)
    recs = scan_journal(params.run_dir / "records" / "d.jsonl").records
    assert summary.status == "finished" and sorted(r["sample_id"] for r in recs) == list(range(40))
    assert all(r["finish_reason"] == "stop" and r["prompt_ids"] for r in recs)
    generation = [r for r in srv.requests if r["path"] == "/chat/completions"]
    assert len(generation) == 40
    if not http2:
        assert srv.connections["h2"] == 0 and srv.connections["http/1.1"] >= 20
        return
    assert 5 <= srv.connections["h2"] <= 8  # ceil(40 / 8) streams-full connections, not one per request


def test_a_server_that_never_completes_the_handshake_times_out_the_warm_up_and_the_requests(tmp_path, monkeypatch):
    """An https server that accepts TCP and never answers the TLS handshake: the engine's warm-up gives up
    after the request timeout, and every request becomes an error record saying it timed out (journaled,
    the run finished) instead of the run hanging before its first request."""
    import orjson

    from eagle3data.generate.run import run_generate
    from eagle3data.core.params import load_params
    from eagle3data.core.records import scan_journal

    from pathlib import Path

    held: list = []

    async def main():
        srv = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        prompts = tmp_path / "p.jsonl"
        prompts.write_bytes(b"".join(orjson.dumps({"sample_id": i, "messages": [
            {"role": "user", "content": f"question {i}"}]}) + b"\n" for i in range(3)))
        monkeypatch.setenv("EAGLE3DATA_TEST_KEY", "sk-or-v1-loopback-not-a-real-key")
        params = load_params(Path(__file__).resolve().parents[1] / "params" / "ci.yaml", {
            "output_root": str(tmp_path / "out"), "run_name": "run", "datasets": [{"name": "d", "path": str(prompts)}],
            "generate.backend": "openai", "generate.concurrency": 3, "generate.timeout_s": 0.5,
            "generate.max_retries": 0,
            "generate.openai": {"base_url": f"https://127.0.0.1:{port}/api/v1", "model": "moonshotai/kimi-k2.5",
                                "api_key_env": "EAGLE3DATA_TEST_KEY", "check_credit": False}})
        try:
            return params, await asyncio.to_thread(run_generate, params, progress=False)
        finally:
            srv.close()
            for w in held:
                w.close()

    params, summary = run(main())
    recs = scan_journal(params.run_dir / "records" / "d.jsonl").records
    assert summary.status == "finished" and len(recs) == 3 and len(held) >= 1
    assert all(r["finish_reason"] == "error" and "timeout after 0.5 s" in r["error"] for r in recs)
