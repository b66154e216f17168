"""SIGINT/SIGTERM while stage 01 runs: routed to the run's own handler, then given back.

The local loop (`local._LocalStop.on_signal`) and the HTTP engine (`Engine.on_signal`, through
the event loop) each install theirs with `_stop_signals` for as long as the run lasts.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def _stop_signals(handler: Any) -> Iterator[None]:
    """SIGINT/SIGTERM go to `handler(signum, frame)` while the run lasts, then back to what they were.

    Only the main thread can set signal handlers; elsewhere (a worker thread) nothing is changed.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
