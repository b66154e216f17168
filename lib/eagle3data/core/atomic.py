"""The one way the project writes a file atomically: a temp name beside it, then a rename, with the umask's mode.

`atomic_path(path)` yields the temp path to write (by any writer: safetensors, torch, pyarrow,
plain bytes), then fsyncs it if asked, gives it the mode a plain `open()` would (0666 less the
umask: 0644 under 022) and renames it over `path`; on an error the temp file is removed. The
mode matters because some writers create their file 0600 whatever the umask (safetensors
0.8's `save_file` writes through a private temp file), and a trainer run as another user or
in a container with another uid could not read it. `write_atomic(path, data)` is the bytes case;
`follow_umask(folder)` mends a folder another library wrote (transformers' `save_pretrained`
writes its weights 0600 through safetensors) before it is renamed into place. `tmp_tag()` is the temp suffix
unique to this process on this host, for files several workers may write at once.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


def umask_mode() -> int:
    """The mode a new file gets from this process's umask (0o644 under 0o022)."""
    try:  # Linux >= 4.7 shows it without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def tmp_tag() -> str:
    """A temp-file suffix unique to this process on this host (workers on a shared disk write the same files)."""
    import socket

    return f".tmp-{socket.gethostname()}-{os.getpid()}"


@contextlib.contextmanager
def atomic_path(path: Path | str, *, tmp_suffix: str = ".tmp", fsync: bool = False) -> Iterator[Path]:
    """Yield `path` + `tmp_suffix` to write; then (fsync,) mode per umask, rename over `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + tmp_suffix)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_atomic(path: Path | str, data: bytes, *, tmp_suffix: str = ".tmp", fsync: bool = False) -> Path:
    """Write `data` to `path` atomically (temp file, rename) with the umask's mode; return `path`."""
    with atomic_path(path, tmp_suffix=tmp_suffix, fsync=fsync) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def follow_umask(folder: Path | str) -> None:
    """Give every file under `folder` the bits the umask allows that it lacks (0600 -> 0644 under 022).

    For a folder another library wrote (the model cache: `save_pretrained`), and for one written before
    this rule; a file this process may not change (another user's cache) is left as it is."""
    want = umask_mode()
    for f in Path(folder).rglob("*"):
        with contextlib.suppress(OSError):
            st = f.lstat()
            if f.is_file() and not f.is_symlink() and st.st_mode & want != want:
                os.chmod(f, (st.st_mode & 0o7777) | want)
