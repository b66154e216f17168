"""Read-ahead: bring files into the page cache before they are used, on a background thread, so a reader's work on
one file overlaps the disk's reading of the next (a store of many GB is read from storage, not from the cache)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# Bytes per POSIX_FADV_WILLNEED call. Linux reads at most the device's read-ahead window per call (the larger of its
# io_pages and read_ahead_kb: 128 KiB here), so one call over a whole 64 MB shard brought only its first 128 KiB
# into the cache (a read 0.5 s later still ran at cold speed); calls of 2 MiB each bring the whole file (docs/04 Cost).
WILLNEED_STEP = 2 * 2**20

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_lock = threading.Lock()


def advise(advice: int, *paths: str | Path, step: int = 0) -> None:
    """posix_fadvise(`advice`) on each whole file (os.POSIX_FADV_*), in calls of `step` bytes (0: one call). A no-op
    where the platform has no posix_fadvise (macOS) or a file cannot be opened."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for at in range(0, max(os.fstat(fd).st_size, 1), step) if step else (0,):
                os.posix_fadvise(fd, at, step, advice)  # releases the GIL; may wait while the disk queue is full
        except OSError:
            pass
        finally:
            os.close(fd)


def will_need(*paths: str | Path) -> Future | None:
    """Start reading each whole file into the page cache (POSIX_FADV_WILLNEED in WILLNEED_STEP calls) on one
    background thread, in the order asked, and return at once (the future of that work; None when there is none)."""
    if not paths or not hasattr(os, "POSIX_FADV_WILLNEED"):
        return None
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():  # a forked worker (torchrun, a pool) starts its own thread
            _pool, _pool_pid = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3data-readahead"), os.getpid()
        return _pool.submit(advise, os.POSIX_FADV_WILLNEED, *paths, step=WILLNEED_STEP)
