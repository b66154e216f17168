"""One writer per run folder: `run.lock.json`, an OS lock (flock) on the file that says who holds it.

`hold_run(run_dir, stage)` is taken by everything that writes a run (`eagle3data run`, `generate`,
`extract`, stage 01's `run_generate`) before any work, and released when it ends. The file holds
the holder's record (pid, host, stage, since, command line, launch): `status` and `stop` read it
(never the lock: reading a run needs no lock), and a second writer is refused with one line
naming that record and the commands that help (`RunFolderBusy`, exit 2).

Why flock (`fcntl.flock`, stdlib) and not the `filelock` package: the OS drops the lock when its
process dies (kill -9, a crash, a reboot), which makes a stale lock recognisable for free; a
shared mode lets the processes of one launch hold it together; and the lock file can carry the
record (filelock truncates its lock file on every attempt and has no shared mode).

- A launch is one `eagle3data run` with the kernels it starts (`LAUNCH_ENV`, set for them) or one
  `torchrun` (its `TORCHELASTIC_RUN_ID` with its master address). The first process of a launch
  takes the lock exclusively, writes the record, then holds it shared; the others of the same
  launch (ranks, kernels) find the record's launch equal to theirs and hold it shared too. The
  folder is free again when the last of them ends.
- A lock left by a dead process: the OS lock is free, the record is still there. On this host that
  is proof enough (the pid is gone); it is taken over with one line saying so. A record from
  another host (a shared file system, whose locks may not reach across hosts) is taken over only
  when its heartbeat is older than `REMOTE_STALE_S`: a holder touches the file every `HEARTBEAT_S`.
- Where the file system has no locks (flock fails with ENOLCK or the like) the record alone decides:
  a live pid on this host, or a fresh heartbeat from another, holds the folder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from eagle3data.core.errors import UserInputError

RUN_LOCK = "run.lock.json"
LAUNCH_ENV = "EAGLE3DATA_LAUNCH"  # set by `eagle3data run` for its kernels: they belong to its launch
HEARTBEAT_S = 30.0
REMOTE_STALE_S = 120.0  # four missed heartbeats: a record from another host older than this is stale


class RunFolderBusy(UserInputError):
    """Another live process writes this run folder; the line names it and the commands that help. Exit 2."""

    status = 2


class RunFolderMissing(UserInputError):
    """A command that writes into an existing run folder (`hold_run(..., create=False)`) was given a path that is none
    (a typo'd path is an error, not a new folder). Exit 2."""

    status = 2


def launch_id() -> str | None:
    """The launch this process belongs to: `eagle3data run`'s (its kernels), a torchrun's, or None (alone)."""
    if os.environ.get(LAUNCH_ENV):
        return os.environ[LAUNCH_ENV]
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun's default run id is "none" for every launch; its master address tells two of those apart
        return (f"torchrun {os.environ['TORCHELASTIC_RUN_ID']} "
                f"@ {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")
    return None


def new_launch_id() -> str:
    """A launch id for an `eagle3data run` (passed to its kernels through `LAUNCH_ENV`)."""
    return f"run {socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def read_lock(run_dir: Path) -> dict[str, Any] | None:
    """The holder's record in `run.lock.json`, or None (no file, empty, or not a record)."""
    p = Path(run_dir) / RUN_LOCK
    for _ in range(5):  # the holder rewrites it in place: a read may catch it half written
        try:
            data = p.read_bytes()
        except OSError:
            return None
        if not data.strip():
            return None
        try:
            rec = orjson.loads(data)
            if isinstance(rec, dict):
                rec["heartbeat_at"] = p.stat().st_mtime
                return rec
        except (orjson.JSONDecodeError, OSError):
            pass
        time.sleep(0.02)
    return None


def pid_alive(pid: Any) -> bool:
    """A process with this pid lives on this host (a zombie does not count)."""
    try:
        import psutil

        return psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (TypeError, ValueError):
        return False
    except Exception:  # noqa: BLE001 - the process went away meanwhile
        return False


def _when(t: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))
    except (TypeError, ValueError):
        return "an unknown time"


def describe(rec: dict[str, Any]) -> str:
    """`01_generate by pid 123 on host h since 2026-12-02 02:30:00 UTC (python -m eagle3data run ...)`."""
    argv = rec.get("argv") or []
    cmd = " ".join(["python -m eagle3data", *argv[1:]]) if argv and str(argv[0]).endswith(("__main__.py", "eagle3data")) \
        else " ".join(map(str, argv))
    rank = f", rank {rec['rank']}" if rec.get("rank") is not None else ""
    return (f"{rec.get('stage') or 'a stage'} by pid {rec.get('pid')} on host {rec.get('host')}{rank} "
            f"since {_when(rec.get('started_at'))}" + (f" ({cmd})" if cmd else ""))


def _record_alive(rec: dict[str, Any]) -> bool:
    """Judged from the record alone: its pid lives on this host, or another host's heartbeat is fresh."""
    if rec.get("host") == socket.gethostname():
        return pid_alive(rec.get("pid"))
    return time.time() - float(rec.get("heartbeat_at") or 0) < REMOTE_STALE_S


def _shown(run_dir: Path) -> str:
    try:
        return str(run_dir.relative_to(Path.cwd()))
    except ValueError:
        return str(run_dir)


def busy_error(run_dir: Path, rec: dict[str, Any] | None) -> RunFolderBusy:
    """The one line a second writer stops with."""
    shown = _shown(run_dir)
    who = describe(rec) if rec else "a process that has not written its record yet"
    gone = ""
    if rec and rec.get("host") == socket.gethostname() and not pid_alive(rec.get("pid")):
        gone = " (that pid is gone; another process of its launch still holds the lock)"
    elif rec and rec.get("host") != socket.gethostname():
        gone = f" (its heartbeat {time.time() - float(rec.get('heartbeat_at') or 0):.0f} s ago)"
    return RunFolderBusy(f"{shown} is in use: {who}{gone}; nothing was written. `eagle3data status {shown}` shows "
                         f"its progress, `eagle3data stop {shown}` stops it gracefully; start again once it has ended")


class _Heartbeat(threading.Thread):
    """Touches the lock file every HEARTBEAT_S while it is held (evidence of life for other hosts)."""

    def __init__(self, fd: int):
        super().__init__(name="run-lock-heartbeat", daemon=True)
        self.fd = fd
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(HEARTBEAT_S):
            try:
                os.utime(self.fd)
            except OSError:
                return


def _flock(fd: int, op: int) -> bool | None:
    """True: granted; False: another holds it; None: this file system has no locks."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return False
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


class RunLock:
    """This process's hold on a run folder (`hold_run`): the holder of the record or a member of its launch."""

    _held: dict[Path, "RunLock"] = {}  # per folder, in this process: a nested hold reuses it
    _guard = threading.Lock()

    def __init__(self, run_dir: Path, stage: str):
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / RUN_LOCK
        self.stage = stage
        self.launch = launch_id()
        self.fd: int | None = None
        self.owner = False  # wrote the record (else a member of the record's launch)
        self.depth = 0
        self.heartbeat: _Heartbeat | None = None
        self.took_over: dict[str, Any] | None = None
        self.tries = 0
        self.rec: dict[str, Any] = {}

    # -------------------------------------------------------------- taking it
    def acquire(self, say: Any = None, create: bool = True) -> "RunLock":
        """Take the folder (or join its launch) or raise RunFolderBusy; says so when a dead holder's lock is taken over.

        `create` False: the folder must exist already (else RunFolderMissing, and nothing is made)."""
        if not create and not self.run_dir.is_dir():
            raise RunFolderMissing(f"{_shown(self.run_dir)}: no such run folder (outputs/<run>)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(50):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                got = self._take(fd)
            except BaseException:
                os.close(fd)
                raise
            if got == "retry":
                os.close(fd)
                time.sleep(0.1)
                continue
            self.fd = fd
            break
        else:
            raise busy_error(self.run_dir, read_lock(self.run_dir))
        self.heartbeat = _Heartbeat(self.fd)
        self.heartbeat.start()
        if self.took_over and say is not None:
            rec = self.took_over
            why = ("its process is gone" if rec.get("host") == socket.gethostname()
                   else f"no heartbeat from host {rec.get('host')} for "
                        f"{time.time() - float(rec.get('heartbeat_at') or 0):.0f} s")
            say(f"took over the lock of {_shown(self.run_dir)} left by {describe(rec)}: {why}")
        return self

    def _same_file(self, fd: int) -> bool:
        """The locked file is still the one at `path` (a releasing holder may have unlinked it meanwhile)."""
        try:
            a, b = os.fstat(fd), os.stat(self.path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _take(self, fd: int) -> str:
        """'ok' (held or joined), 'retry' (look again with a new descriptor), or raise RunFolderBusy."""
        ex = _flock(fd, fcntl.LOCK_EX)
        if ex is False:  # held: join when it is this process's own launch, else refuse
            if self.launch:
                for _ in range(50):  # the launch's first process holds it exclusively until its record is written
                    if _flock(fd, fcntl.LOCK_SH):
                        if not self._same_file(fd):
                            return "retry"
                        rec = read_lock(self.run_dir)
                        if rec and rec.get("launch") == self.launch:
                            return "ok"
                        break
                    rec = read_lock(self.run_dir)
                    if rec and rec.get("launch") != self.launch and pid_alive(rec.get("pid")):
                        break  # a live writer of another launch (a dead one's record is about to be replaced)
                    time.sleep(0.1)
            raise busy_error(self.run_dir, read_lock(self.run_dir))
        if ex and not self._same_file(fd):
            return "retry"
        rec = read_lock(self.run_dir)
        other = rec if rec and rec.get("pid") != os.getpid() else None
        here = bool(other) and other.get("host") == socket.gethostname()
        if ex is None:  # no OS locks on this file system: the record alone decides
            if other and _record_alive(other):
                if self.launch and other.get("launch") == self.launch:
                    return "ok"
                raise busy_error(self.run_dir, other)
        elif other and not here and _record_alive(other):
            raise busy_error(self.run_dir, other)  # another host's live holder: its locks may not reach this one
        elif here and other.get("launch") and pid_alive(other.get("pid")) and self.tries < 10:
            # caught while a launch's first process turns its exclusive hold into a shared one (or the pid was reused)
            fcntl.flock(fd, fcntl.LOCK_UN)
            self.tries += 1
            return "retry"
        self.took_over = other
        self._write_record(fd)
        self.owner = True
        if ex and self.launch:
            fcntl.flock(fd, fcntl.LOCK_SH)  # the rest of this launch may join now
        return "ok"

    def _record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "stage": self.stage,
                "started_at": time.time(), "argv": list(sys.argv), "launch": self.launch,
                "rank": int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None}

    def _write_record(self, fd: int, rec: dict[str, Any] | None = None) -> None:
        self.rec = rec or self._record()
        data = orjson.dumps(self.rec)
        os.pwrite(fd, data, 0)  # then cut: a reader sees the old record, the new one, or a torn one (and reads again)
        os.ftruncate(fd, len(data))
        os.fsync(fd)

    def set_stage(self, stage: str) -> None:
        """The stage now running (shown by `status` and in a refusal); only the record's writer changes it."""
        self.stage = stage
        if self.owner and self.fd is not None:
            self._write_record(self.fd, {**self.rec, "stage": stage})

    # -------------------------------------------------------------- letting go
    def release(self) -> None:
        """Let go; the last process of the launch removes the file (the folder is free)."""
        if self.fd is None:
            return
        if self.heartbeat is not None:
            self.heartbeat.done.set()
        fd, self.fd = self.fd, None
        try:
            alone = _flock(fd, fcntl.LOCK_EX)  # True: no other process of the launch holds it any more
            rec = read_lock(self.run_dir)
            mine = rec is None or rec.get("pid") == os.getpid()
            if self._same_file(fd) and (mine if alone is None else alone and (mine or rec.get("launch") == self.launch)):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """End this hold (`hold_run`'s nesting counted): the outermost one releases the lock."""
        with RunLock._guard:
            self.depth -= 1
            if self.depth > 0:
                return
            RunLock._held.pop(self.run_dir, None)
        self.release()


def hold_run(run_dir: Path, stage: str, say: Any = None, *, create: bool = True) -> RunLock:
    """Take the run folder for `stage` (a context manager; nested holds in one process share one), or raise RunFolderBusy.

    `say(line)`: where the line about a taken-over stale lock goes (default: stderr). `create` False: for a command
    that writes into a run made before (`export`, `verify-hidden`): a folder that does not exist is RunFolderMissing
    (one line, exit 2) and is not made."""
    key = Path(run_dir).resolve()
    with RunLock._guard:
        held = RunLock._held.get(key)
        if held is not None:
            held.depth += 1
            return held
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    lock = RunLock(key, stage).acquire(say, create=create)
    with RunLock._guard:
        lock.depth = 1
        RunLock._held[key] = lock
    return lock
