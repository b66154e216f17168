"""Read-ahead: ask the kernel to bring files into the page cache before they are used, so a reader's work on one
file overlaps the disk's reading of the next (a store of many GB is read from storage, not from the cache)."""

from __future__ import annotations

import os
from pathlib import Path


def advise(advice: int, *paths: str | Path) -> None:
    """posix_fadvise(`advice`) on each whole file (os.POSIX_FADV_*). A no-op where the platform has no posix_fadvise
    (macOS) or a file cannot be opened."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass
        finally:
            os.close(fd)


def will_need(*paths: str | Path) -> None:
    """POSIX_FADV_WILLNEED on each whole file: the kernel starts reading it now and returns at once."""
    if hasattr(os, "POSIX_FADV_WILLNEED"):
        advise(os.POSIX_FADV_WILLNEED, *paths)
