"""Response handling under the engine: one request sent with its retries, and what its answer means.

`RequestRetries._send` sends one request (the backend's body, the transport the engine
opened) and turns its answer into the records to journal: a 200 body parsed by the backend
(`ResponseError`, a malformed body, makes error records); 429 waits `Retry-After`
(`retry_after_seconds`: all requests pause) up to `max_rate_limit_retries`; 408/5xx,
connection errors and timeouts retry with jittered exponential backoff (`_backoff`), then
become error records; 402 (out of credits), 401/403 (key refused) and 404 raise
`StopDispatch`, on which the engine stops dispatching at once; any other status is an error
record with the body's message (`error_message`). A mixin of `engine.Engine`: it reads the
engine's `backend`, settings `s`, `ledger`, `rng`, `pause_until` and the `_transport`,
`_url` and `_headers` that `Engine.run` prepares.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from typing import Any

import httpx
import orjson


class ResponseError(ValueError):
    """A response body is malformed or truncated: the sample becomes an error record."""


class StopDispatch(Exception):
    """Raised by a request whose answer means no further request may be sent (402, 401, 403)."""


def retry_after_seconds(value: str | None, default: float) -> float:
    """Seconds to wait from a Retry-After header (delta seconds or HTTP date)."""
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return default


def error_message(body: bytes, limit: int = 300) -> str:
    """The `error.message` of an error body, or the start of the body as text."""
    try:
        obj = orjson.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:limit]
        if isinstance(err, str):
            return err[:limit]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return body[:limit].decode("utf-8", "replace")


class RequestRetries:
    """Sending one request with its retries (a mixin of `engine.Engine`: see the module docstring)."""

    async def _wait_pause(self) -> None:
        while True:
            delay = self.pause_until - time.monotonic()
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    def _backoff(self, attempt: int) -> float:
        base = min(self.s.retry_backoff_max_s, self.s.retry_backoff_s * 2 ** (attempt - 1))
        return base * self.rng.uniform(0.5, 1.5)

    async def _send(self, jobs: list[Any]) -> list[dict[str, Any]]:
        """Send one request with retries; the records to journal (error records when it failed)."""
        body = self.backend.build(jobs)
        attempt = rate_limited = 0
        while True:
            await self._wait_pause()
            t0 = time.perf_counter()
            problem: str
            try:
                async with asyncio.timeout(self.s.timeout_s):
                    status, resp_headers, data = await self._transport.send(
                        self._url, b"POST", self._headers + [(b"content-length", b"%d" % len(body))], body)
            except TimeoutError:
                problem = f"timeout after {self.s.timeout_s:g} s"
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                latency = time.perf_counter() - t0
                if status == 200:
                    try:
                        return self.backend.parse(jobs, data, latency)
                    except ResponseError as e:
                        return [self.backend.error_record(j, f"malformed response: {e}") for j in jobs]
                msg = error_message(data)
                if status == 429:
                    rate_limited += 1
                    if rate_limited > self.s.max_rate_limit_retries:
                        return [self.backend.error_record(j, f"HTTP 429 {rate_limited} times: {msg}") for j in jobs]
                    retry_after = next((v.decode("latin-1") for k, v in resp_headers if k == b"retry-after"), None)
                    wait = retry_after_seconds(retry_after, self._backoff(rate_limited))
                    self.pause_until = max(self.pause_until, time.monotonic() + wait)
                    for j in jobs:
                        self.ledger[j.dataset].retries += 1
                    continue
                if status == 402:
                    raise StopDispatch(f"HTTP 402 from the API (out of credits): {msg}")
                if status in (401, 403):
                    raise StopDispatch(f"HTTP {status} from the API (key refused): {msg}")
                if status == 404:  # every later request would get the same answer
                    raise StopDispatch(f"HTTP 404 from the API (no such endpoint or model, or provider routing "
                                        f"leaves none: check base_url, model and provider params): {msg}")
                if status == 408 or status >= 500:
                    problem = f"HTTP {status}: {msg}"
                else:
                    return [self.backend.error_record(j, f"HTTP {status}: {msg}") for j in jobs]
            attempt += 1
            if attempt > self.s.max_retries:
                return [self.backend.error_record(j, f"{problem} (after {attempt} attempts)") for j in jobs]
            for j in jobs:
                self.ledger[j.dataset].retries += 1
            await asyncio.sleep(self._backoff(attempt))
