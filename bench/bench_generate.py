"""Benchmark 01_generate's HTTP engine over plain HTTP and over TLS, with three HTTP clients under it.

A loopback OpenAI-compatible server (tests/loopback.py: raw asyncio, prepared 1-8 KB
reasoning+content bodies, in its own process on its own core) answers every request after
a fixed latency L. Over TLS it serves a self-signed ECDSA P-256 certificate that this bench
makes with `openssl` (trusted by the clients through SSL_CERT_FILE / an SSL context) and
offers HTTP/2 (256 streams per connection, as large CDNs) beside HTTP/1.1 by ALPN, as
public HTTPS servers do. The clients run on the other core(s), each in a fresh process
(clean CPU and RSS figures), at the same number in flight, journaling every response:

- `lean`: `run_generate` (backend `openai`) on the engine's own transport
  (`backends/transport.py`): over TLS HTTP/2 (`h2`), up to 100 streams per connection, so
  2,000 in flight open 20 connections; over plain HTTP, HTTP/1.1 keep-alive on h11;
- `lean_h1`: the same transport with HTTP/2 off (`generate.http2: false`; HTTP/1.1 keep-alive on h11, a free list of
  idle connections: 2,000 connections, 2,000 TLS handshakes);
- `aiohttp`: the same `run_generate` with aiohttp's connector under the engine
  (`engine.TRANSPORT` swapped; aiohttp keeps a per-host deque of idle connections, HTTP/1.1);
- `httpx_h2`: the same with httpx's own transport speaking HTTP/2 (httpcore + h2);
- `curl_h2`: the same with curl_cffi's AsyncSession (libcurl, nghttp2 and BoringSSL in C: HTTP/2
  streams over a few connections, PIPEWAIT so a request waits for a connection with room);
- `baseline`: `openai.OpenAI(...).chat.completions.create` on a ThreadPoolExecutor of the
  in-flight size (its httpx pool widened to match), one journal line per response.

Figures per run (written to outputs/bench/generate.json): whole-run throughput over the
bound `in_flight / L` (responses over the wall time of the whole `run_generate` call: journal
scan, templating, preflight, connection ramp incl. TLS handshakes, last wave's tail), CPU
seconds per 1,000 responses, peak RSS, the ramp as its own figure (call start -> the
in_flight-th request sent), and the steady state. The goals, over TLS: >= 0.95 of the bound
over the whole run, <= 0.1x the baseline's CPU per response. The 1-minute load average is
recorded (the machine is shared). `--long-waves N` adds one longer run of `lean` over TLS
(`lean/tls_long`): the ramp is paid once per run, so the whole-run figure of a real run
(hours) is near its steady state. Run: `.venv/bin/python bench/bench_generate.py`
(`--in-flight 2000 --latency 4 --waves 10`; `--clients`, `--schemes` to measure fewer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))

KEY_ENV = "EAGLE3DATA_BENCH_KEY"
CLIENTS = ("lean", "lean_h1", "aiohttp", "httpx_h2", "curl_h2")
TLS_ONLY = ("httpx_h2", "curl_h2")  # HTTP/2 clients: HTTP/2 is negotiated through TLS (ALPN), as at OpenRouter


class PeakRSS:
    """Samples this process's RSS on a thread; `peak` is the largest seen since start()."""

    def __init__(self, every_s: float = 0.1):
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()

    def __enter__(self) -> "PeakRSS":
        self.peak = self._proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


# -- the two library clients under the engine (same interface as transport.LeanTransport) -----------

def _transports():
    import httpx

    class _Base(httpx.AsyncBaseTransport):
        @staticmethod
        def _str_headers(headers):
            """The engine's headers as a str dict, less those the library sets itself."""
            return {k.decode(): v.decode() for k, v in headers if k not in (b"host", b"content-length")}

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = await request.aread()
            status, headers, content = await self.send(request.url, request.method.encode(),
                                                       list(request.headers.raw), body)
            return httpx.Response(status, headers=headers, content=content, request=request)

    class AiohttpTransport(_Base):
        """aiohttp's ClientSession + TCPConnector (no connection limit: the engine bounds what is in flight)."""

        def __init__(self):
            self._session = None
            self._urls: dict = {}

        def _get(self):
            import aiohttp

            if self._session is None:
                conn = aiohttp.TCPConnector(limit=0, ssl=httpx.create_ssl_context(), ttl_dns_cache=None)
                self._session = aiohttp.ClientSession(connector=conn, auto_decompress=False,
                                                      timeout=aiohttp.ClientTimeout(total=None))
            return self._session

        async def send(self, url, method, headers, body):
            import aiohttp
            import yarl

            u = self._urls.get(url)
            if u is None:
                u = self._urls[url] = yarl.URL(str(url), encoded=True)
            hdrs = self._str_headers(headers)
            try:
                async with self._get().request(method.decode(), u, data=body, headers=hdrs) as r:
                    data = await r.read()
                    return r.status, [(k.lower(), v) for k, v in r.raw_headers], data
            except aiohttp.ClientConnectorError as e:
                raise httpx.ConnectError(str(e)) from None
            except aiohttp.ClientError as e:
                raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}") from None

        async def aclose(self) -> None:
            if self._session is not None:
                await self._session.close()

    class HttpxH2Transport(_Base):
        """httpx's AsyncHTTPTransport with HTTP/2 (httpcore + h2): requests multiplexed as streams."""

        def __init__(self):
            self._t = httpx.AsyncHTTPTransport(http2=True, limits=httpx.Limits(max_connections=None,
                                                                               max_keepalive_connections=None))

        async def send(self, url, method, headers, body):
            resp = await self._t.handle_async_request(httpx.Request(method, url, headers=headers, content=body))
            data = await resp.aread()
            if resp.extensions.get("http_version") != b"HTTP/2":
                raise httpx.RemoteProtocolError(f"not HTTP/2: {resp.extensions.get('http_version')!r}")
            return resp.status_code, list(resp.headers.raw), data

        async def aclose(self) -> None:
            await self._t.aclose()

    class CurlH2Transport(_Base):
        """curl_cffi's AsyncSession (libcurl + nghttp2 + BoringSSL): HTTP/2 streams multiplexed over a few
        connections (PIPEWAIT: a request waits for a connection that may take it rather than opening one)."""

        def __init__(self):
            self._s = None

        def _get(self):
            from curl_cffi import CurlHttpVersion, CurlOpt
            from curl_cffi.requests import AsyncSession

            if self._s is None:
                self._s = AsyncSession(max_clients=100000, http_version=CurlHttpVersion.V2TLS,
                                       verify=os.environ.get("SSL_CERT_FILE", True),
                                       curl_options={CurlOpt.PIPEWAIT: 1})
            return self._s

        async def send(self, url, method, headers, body):
            from curl_cffi.requests.exceptions import RequestException

            hdrs = self._str_headers(headers)
            try:
                r = await self._get().request(method.decode(), str(url), data=body, headers=hdrs,
                                              default_headers=False, timeout=None)
            except RequestException as e:
                raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}") from None
            return r.status_code, [(k.lower().encode(), v.encode()) for k, v in r.headers.items()], r.content

        async def aclose(self) -> None:
            if self._s is not None:
                await self._s.close()

    return {"aiohttp": AiohttpTransport, "httpx_h2": HttpxH2Transport, "curl_h2": CurlH2Transport}


# -- one measured run (in its own process) ----------------------------------------------------------

def steady_state(journal: Path, latency: float, in_flight: int, t_call: float) -> dict:
    """Completions per second from L after the first request went out to L before the last response; the ramp."""
    import numpy as np

    recs = [r for r in map(orjson.loads, journal.read_bytes().splitlines()) if r.get("latency_s") is not None]
    end = np.array([r["created_at"] for r in recs])
    start = end - np.array([r["latency_s"] for r in recs])
    lo, hi = start.min() + latency, end.max() - latency
    n = int(((end >= lo) & (end < hi)).sum())
    first_wave = float(np.sort(start)[min(len(start), in_flight) - 1])
    return {"window_s": hi - lo, "responses": n, "responses_per_s": n / (hi - lo),
            "ramp_s": first_wave - t_call, "first_request_s": float(start.min()) - t_call,
            "first_wave_dispatch_s": first_wave - float(start.min()),
            "mean_latency_s": float((end - start).mean())}


def run_ours(client: str, base_url: str, prompts: Path, out: Path, n: int, in_flight: int, latency: float) -> dict:
    from eagle3data.generate.backends import engine
    from eagle3data.generate.run import run_generate
    from eagle3data.core.models import tokenizer_for
    from eagle3data.core.params import load_params

    if client not in ("lean", "lean_h1"):
        engine.TRANSPORT = _transports()[client]
    params = load_params(REPO / "params" / "ci.yaml", {
        "output_root": str(out), "run_name": client, "datasets": [{"name": "bench", "path": str(prompts), "limit": n}],
        "generate.backend": "openai", "generate.concurrency": in_flight, "generate.timeout_s": latency * 10 + 30,
        "generate.sampling.max_new_tokens": 2048, "generate.http2": client != "lean_h1",
        "generate.openai": {"base_url": base_url, "model": "moonshotai/kimi-k2.5", "api_key_env": KEY_ENV,
                            "check_credit": False,
                            "provider": {"quantizations": ["int4"], "ignore": ["fp4-provider"]},
                            "reasoning": {"enabled": True}},
    })
    tok = tokenizer_for(params)
    cpu0, t0, wall0 = time.process_time(), time.perf_counter(), time.time()
    with PeakRSS() as rss:
        s = run_generate(params, progress=False, tokenizer=tok)
    total_cpu, total_s = time.process_time() - cpu0, time.perf_counter() - t0
    done = int(s.table()["done"].sum())
    errors = int(s.table()["errors"].sum())
    res = {"responses": done, "errors": errors, "seconds": total_s, "responses_per_s": done / total_s,
           "cpu_s": total_cpu, "cpu_s_per_1000": 1000 * total_cpu / max(1, done), "peak_rss_mb": rss.peak / 2**20,
           "engine_seconds": s.engine_seconds, "engine_cpu_s": s.engine_cpu_s,
           "plan_cpu_s": total_cpu - s.engine_cpu_s, "status": s.status, "stop_reason": s.stop_reason}
    if done:
        res["steady_state"] = steady_state(out / client / "records" / "bench.jsonl", latency, in_flight, wall0)
    return res


def run_baseline(base_url: str, prompts: Path, out: Path, n: int, in_flight: int, latency: float) -> dict:
    import httpx
    import openai

    from eagle3data.core.records import Journal

    rows = [orjson.loads(line) for line in prompts.read_bytes().splitlines()[:n]]
    client = openai.OpenAI(base_url=base_url, api_key=os.environ[KEY_ENV], max_retries=0, timeout=latency * 10 + 30,
                           http_client=httpx.Client(limits=httpx.Limits(max_connections=in_flight,
                                                                        max_keepalive_connections=in_flight)))
    journal = Journal(out / "baseline.jsonl")
    lock = threading.Lock()

    def one(row: dict) -> None:
        r = client.chat.completions.create(
            model="moonshotai/kimi-k2.5", messages=row["messages"], max_tokens=2048, temperature=0.0,
            extra_body={"provider": {"quantizations": ["int4"], "ignore": ["fp4-provider"]},
                        "reasoning": {"enabled": True}})
        ch = r.choices[0]
        rec = {"dataset": "bench", "sample_id": row["sample_id"], "content": ch.message.content,
               "reasoning": getattr(ch.message, "reasoning", None), "finish_reason": ch.finish_reason,
               "usage": r.usage.model_dump() if r.usage else None, "provider": getattr(r, "provider", None),
               "id": r.id}
        with lock:
            journal.write(rec)

    cpu0, t0 = time.process_time(), time.perf_counter()
    with PeakRSS() as rss, ThreadPoolExecutor(max_workers=in_flight) as pool:
        futures = [pool.submit(one, row) for row in rows]
        errors = sum(1 for f in futures if f.exception() is not None)
    cpu, secs = time.process_time() - cpu0, time.perf_counter() - t0
    journal.close()
    client.close()
    done = n - errors
    return {"responses": done, "errors": errors, "seconds": secs, "responses_per_s": done / secs, "cpu_s": cpu,
            "cpu_s_per_1000": 1000 * cpu / max(1, done), "peak_rss_mb": rss.peak / 2**20}


def child(args) -> None:
    """`--child CLIENT`: one measured run in this (fresh) process; prints `RESULT {json}`."""
    out = Path(args.work) / f"{args.child}_{args.tag}"
    out.mkdir(parents=True, exist_ok=True)
    prompts = Path(args.work) / "prompts.jsonl"
    if args.child == "baseline":
        res = run_baseline(args.base_url, prompts, out, args.n, args.in_flight, args.latency)
    else:
        res = run_ours(args.child, args.base_url, prompts, out, args.n, args.in_flight, args.latency)
    shutil.rmtree(out, ignore_errors=True)
    print("RESULT " + json.dumps(res), flush=True)


# -- orchestration ----------------------------------------------------------------------------------

def make_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed ECDSA P-256 certificate for 127.0.0.1 (what most HTTPS sites serve), valid 2 days."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def start_server(latency: float, core: int | None, cert: tuple[Path, Path] | None):
    cmd = [sys.executable, str(REPO / "tests" / "loopback.py"), "--kind", "openai", "--latency", str(latency),
           "--body-min", "1024", "--body-max", "8192"]
    if cert:  # HTTP/2 and HTTP/1.1 by ALPN, each client takes what it speaks
        cmd += ["--tls-cert", str(cert[0]), "--tls-key", str(cert[1]), "--http2", "--h2-max-streams", "256"]
    pre = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=pre)
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise SystemExit(f"loopback server did not start: {line!r}")
    return proc, int(line.split()[1])


def measure(client: str, scheme: str, args, n: int, cert, server_core, client_cores, env) -> dict:
    tls = scheme == "tls"
    proc, port = start_server(args.latency, server_core, cert if tls else None)
    base_url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/api/v1"
    server = psutil.Process(proc.pid)
    scpu0 = sum(server.cpu_times()[:2])
    cmd = [sys.executable, __file__, "--child", client, "--tag", scheme, "--base-url", base_url, "--n", str(n),
           "--in-flight", str(args.in_flight), "--latency", str(args.latency), "--work", str(args.work)]
    pre = lambda: os.sched_setaffinity(0, client_cores)  # noqa: E731
    # A client this far off the bound has failed (or hangs); the thread-pool baseline runs at ~0.05 of the
    # bound by nature (its one wave took 83 s), so it gets 60 times the ideal time.
    ideal = n / args.in_flight * args.latency
    limit = (60 if client == "baseline" else 3) * ideal + 60
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=pre, timeout=limit)
    except subprocess.TimeoutExpired as e:
        return {"failed": True, "stderr_tail": f"killed after {limit:.0f} s: {(e.stderr or b'')[-1500:]!r}"}
    finally:
        server_cpu = sum(server.cpu_times()[:2]) - scpu0
        proc.kill()
        proc.wait()
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"failed": True, "stderr_tail": r.stderr[-2000:]}
    res = json.loads(line[len("RESULT "):])
    res["server_cpu_s"] = server_cpu
    res["server_core_busy"] = server_cpu / res["seconds"]
    res["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    bound = args.in_flight / args.latency
    res["throughput_over_bound"] = res["responses_per_s"] / bound
    if "steady_state" in res:
        res["steady_state"]["throughput_over_bound"] = res["steady_state"]["responses_per_s"] / bound
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--in-flight", type=int, default=2000)
    ap.add_argument("--latency", type=float, default=4.0)
    ap.add_argument("--waves", type=int, default=10, help="responses = waves x in-flight (ours)")
    ap.add_argument("--baseline-waves", type=int, default=1,
                    help="baseline responses = this x in-flight (it is slow: ~20 CPU-ms per response)")
    ap.add_argument("--clients", default=",".join(CLIENTS + ("baseline",)))
    ap.add_argument("--schemes", default="plain,tls")
    ap.add_argument("--long-waves", type=int, default=30, help="waves of the longer lean/tls run (0: none)")
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench"))
    # child mode (one measured run)
    ap.add_argument("--child")
    ap.add_argument("--tag", default="")
    ap.add_argument("--base-url")
    ap.add_argument("--n", type=int)
    ap.add_argument("--work")
    args = ap.parse_args()
    os.environ.setdefault(KEY_ENV, "sk-bench-not-a-real-key")
    if args.child:
        return child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = args.work = out / "generate_work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    n = args.waves * args.in_flight
    with open(work / "prompts.jsonl", "wb") as f:
        for i in range(max(n, args.baseline_waves * args.in_flight)):
            f.write(orjson.dumps({"sample_id": i, "messages": [
                {"role": "user", "content": f"Question {i}: explain step by step how to compute the sum of the "
                                            f"first {i % 97 + 3} odd numbers, then check the result."}]}) + b"\n")
    cert = make_cert(work)
    env = {**os.environ, "SSL_CERT_FILE": str(cert[0]), "PYTHONUNBUFFERED": "1"}
    cores = sorted(os.sched_getaffinity(0))
    server_core = cores[-1] if len(cores) > 1 else None
    client_cores = set(cores[:-1]) if len(cores) > 1 else set(cores)
    bound = args.in_flight / args.latency
    clients = args.clients.split(",")
    schemes = args.schemes.split(",")
    load_before = os.getloadavg()[0]
    print(f"bench: {n} responses at {args.in_flight} in flight, L={args.latency:g} s, bound {bound:.0f}/s; "
          f"client cores {sorted(client_cores)}, server core {server_core}; {clients} x {schemes}", flush=True)
    runs: dict[str, dict] = {}
    for scheme in schemes:
        for client in clients:
            if client in TLS_ONLY and scheme != "tls":
                continue
            m = args.baseline_waves * args.in_flight if client == "baseline" else n
            res = measure(client, scheme, args, m, cert, server_core, client_cores, env)
            runs[f"{client}/{scheme}"] = res
            print(f"{client:9s} {scheme:5s}", json.dumps(res), flush=True)
    if args.long_waves and "lean" in clients and "tls" in schemes:
        m = args.long_waves * args.in_flight
        with open(work / "prompts.jsonl", "ab") as f:  # more prompts for the longer run
            for i in range(max(n, args.baseline_waves * args.in_flight), m):
                f.write(orjson.dumps({"sample_id": i, "messages": [
                    {"role": "user", "content": f"Question {i}: explain step by step how to compute the sum of "
                                                f"the first {i % 97 + 3} odd numbers, then check the result."}]}) + b"\n")
        res = runs["lean/tls_long"] = measure("lean", "tls", args, m, cert, server_core, client_cores, env)
        res["waves"] = args.long_waves
        print(f"{'lean':9s} tls_long", json.dumps(res), flush=True)
    result = {
        "in_flight": args.in_flight, "latency_s": args.latency, "responses": n,
        "baseline_responses": args.baseline_waves * args.in_flight, "bound_responses_per_s": bound,
        "client_cores": len(client_cores), "server_core_separate": server_core is not None,
        "tls": "self-signed ECDSA P-256 certificate for 127.0.0.1 made by the bench (openssl), TLS 1.3",
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "load_average_means": "1-minute load (2 cores) before and after all runs: other jobs ran too",
        "throughput_over_bound_means": "whole run_generate call (plan, templating, preflight, connection ramp incl. "
                                       "TLS handshakes, tail) over responses; the ramp is steady_state.ramp_s "
                                       "(call start -> the in_flight-th request sent)",
        "cpu_s_per_1000_means": "all CPU of the client process's run_generate call (incl. templating, which the "
                                "baseline does not do); baseline: the thread pool's CPU",
        "body_bytes": [1024, 8192], "journaling": True, "runs": runs,
        "goals_over_tls": {"throughput_over_bound": ">= 0.95", "cpu_per_1000_ratio_vs_baseline": "<= 0.1"},
    }
    for name, r in runs.items():
        client, scheme = name.split("/")
        base = runs.get(f"baseline/{scheme.removesuffix('_long')}")
        if client != "baseline" and base and not r.get("failed") and not base.get("failed"):
            r["cpu_per_1000_ratio_vs_baseline"] = r["cpu_s_per_1000"] / base["cpu_s_per_1000"]
            r["peak_rss_ratio_vs_baseline"] = r["peak_rss_mb"] / base["peak_rss_mb"]
    lean = runs.get("lean/tls")
    if lean and not lean.get("failed"):
        result["lean_vs_libraries_over_tls"] = {
            c: {"throughput_ratio": lean["responses_per_s"] / r["responses_per_s"],
                "cpu_per_1000_ratio": lean["cpu_s_per_1000"] / r["cpu_s_per_1000"],
                "peak_rss_ratio": lean["peak_rss_mb"] / r["peak_rss_mb"]}
            for c in CLIENTS if c != "lean" and (r := runs.get(f"{c}/tls")) and not r.get("failed")}
    result["chosen_client"] = ("lean: backends/transport.py (HTTP/2 over TLS where the server offers it, h2 library; "
                               "HTTP/1.1 keep-alive on h11 otherwise)")
    goals = {}
    for name in ("lean/tls", "lean/tls_long"):
        r = runs.get(name)
        if r and not r.get("failed"):
            goals[name] = {"throughput_over_bound": round(r["throughput_over_bound"], 4),
                           "throughput_goal_met": r["throughput_over_bound"] >= 0.95,
                           "cpu_per_1000_ratio_vs_baseline": r.get("cpu_per_1000_ratio_vs_baseline"),
                           "cpu_goal_met": (r.get("cpu_per_1000_ratio_vs_baseline") or 1) <= 0.1}
    result["goals_over_tls_measured"] = goals
    (out / "generate.json").write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)  # journals of every run: only the figures are kept
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
