"""A server 04 launched, watched while it captures: when it dies, the capture stops at once (issue 52).

`WatchedEngine` is mixed into 04's engine clients (`vllm_capture.HiddenEngine`, `sglang_capture.PassEngine`):
given the launched server (`VLLMServer` / `SGLangServer`; None for a server started elsewhere), a task beside
the requests polls it; once its process has exited, or its log says its scheduler died (`dead_reason`), the
engine stops dispatching and cancels what is in flight (those samples are not stored and not failed: a rerun
sends them), and the capture raises `engine_died`'s `EngineDied`, one line naming the server's log. What came
back before is kept (the writer flushes); the caller's `with` stops what is left of the server's process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

from eagle3data.hidden.store.failures import EngineDied

POLL_S = 0.25


def server_death(server: Any) -> str | None:
    """Why a launched server is dead ("killed by SIGKILL", "exit status 1", a log line), or None while it lives."""
    proc = getattr(server, "proc", None)
    if proc is None:
        return "stopped"
    code = proc.poll()
    if code is not None:
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"
    return server.dead_reason()


class WatchedEngine:
    """Mixin for an `Engine` (before it in the bases): `self.server` watched while `run()` runs; `self.died`."""

    server: Any = None
    died: str | None = None

    async def run(self) -> Any:
        if self.server is None:
            return await super().run()  # type: ignore[misc]
        watch = asyncio.create_task(self._watch_server())
        try:
            return await super().run()  # type: ignore[misc]
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def _watch_server(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            why = await asyncio.to_thread(server_death, self.server)
            if why is None:
                continue
            self.died = why
            self.request_stop(f"the {self.server.engine} server died ({why})", grace=False)  # type: ignore[attr-defined]
            self.cancel_now = True  # what is in flight cannot come back: cancelled, sent again by a rerun
            for t in list(self._tasks):  # type: ignore[attr-defined]
                t.cancel()
            return


def engine_died(server: Any, why: str, stored: int, planned: int, what: str = "") -> EngineDied:
    """The one line of a capture whose launched server died under it."""
    return EngineDied(f"the {server.engine} server 04 launched died during the capture{what} ({why}): {stored} of "
                      f"{planned} samples stored and kept; its log: {server.cmd.log}; run the same command again to "
                      "resume")
