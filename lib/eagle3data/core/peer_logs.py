"""The peer libraries' chatter into a run's log file, not into the notebook: `peers_to_log(path)`.

While a stage runs a peer's code (speculators, transformers, datasets, torch, hs-connectors, ...), what those
libraries say on their own goes to `path` (appended, one line each, with the logger's name), and what the stage says
(`say`, `core.progress.Progress`: stdout, a notebook display, stderr on a terminal) still reaches the user:

- Python `logging`: the peers' top-level loggers (`PEERS`) and any of their children that carry handlers of their
  own (transformers', datasets' and torch's stream handlers on stderr) get the file's handler instead and do not
  propagate (their libraries' set-up made first, `PRIMED`, so that an import inside the block adds no stderr
  handler beside it); a record that no handler takes (`logging.lastResort`) goes to the file unless it is the
  project's (`eagle3data`), the notebook's (`__main__`) or the root logger's (`OWN`).
- loguru (speculators' `utils.loading`: "Tensor 'lm_head.weight' not found in weight_map", "Loading from local
  directory"): a sink to the file for every module but `OWN`'s, and every other loguru handler (its default one
  holds the stderr of the moment loguru was imported: a notebook's stderr stream) skips those meanwhile.
- `warnings` that pass the filters (transformers' `past_key_values` FutureWarning raised in kernels, torch's
  lr_scheduler UserWarning), all of them (a peer's warning may name the project's line that called it):
  `warnings.showwarning` writes them to the file (as `py.warnings`, the name `logging.captureWarnings` gives them).
  The filters are not touched: a warning shown once per place is not shown again after the block.
- progress bars: datasets', transformers' and huggingface_hub's own switches, off.

Nothing is written to sys.stderr by these libraries during 06's training but through the above (checked with the
real training, tests/test_peer_logs.py), so sys.stderr is not redirected: a terminal's progress line stays, and an
exception leaves the block unchanged, its traceback shown by whoever catches it. Every switch is put back as it was
on exit, and blocks nest.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

PEER_LOG = "peers.log"  # a stage's log file of them: value/<variant>/peers.log, export/peers.log

# top-level logger names of the libraries 06 runs (and their transport), whose loggers get the file's handler
# (another library's record reaches the file through logging's last resort)
PEERS = ("speculators", "transformers", "datasets", "huggingface_hub", "torch", "hs_connectors", "kernels", "vllm",
         "safetensors", "accelerate", "httpx", "httpcore", "urllib3", "filelock", "fsspec")

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# what is not a peer's: the project's own lines, a notebook's (`__main__`) and the root logger's
OWN = ("eagle3data", "__main__", "root")


def is_peer(name: str | None) -> bool:
    """A logger's or module's name that is not the project's, the notebook's or the root logger's."""
    return bool(name) and str(name).split(".", 1)[0] not in OWN


class _Resort(logging.Handler):
    """`logging.lastResort` within the block: a peer's record that no handler took to the file, any other to the
    last resort found (stderr)."""

    def __init__(self, file: logging.Handler, last: logging.Handler | None):
        super().__init__(last.level if last is not None else logging.WARNING)
        self.file, self.last = file, last

    def emit(self, record: logging.LogRecord) -> None:
        if is_peer(record.name):
            self.file.handle(record)
        elif self.last is not None:
            self.last.handle(record)


class _Line:
    """The log file, written one line at a time from any thread."""

    def __init__(self, f: Any):
        self.f, self.lock = f, threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            self.f.write(text if text.endswith("\n") else text + "\n")
            self.f.flush()

    def flush(self) -> None:
        pass  # every write is flushed


def _handler(out: _Line, level: int = logging.NOTSET) -> logging.Handler:
    h = logging.StreamHandler(out)  # type: ignore[arg-type]
    h.terminator = ""  # _Line ends each record
    h.setFormatter(logging.Formatter(FORMAT))
    h.setLevel(level)
    return h


# the logging set-up a peer makes on its first import (a stream handler on stderr): made before the block swaps the
# handlers, so that a peer imported inside the block does not add its own beside the file's
PRIMED = ("torch", "transformers.utils.logging", "datasets.utils.logging", "huggingface_hub.utils.logging")


def _prime() -> None:
    for name in PRIMED:
        mod = _module(name)
        if mod is not None and hasattr(mod, "get_logger"):
            mod.get_logger()  # the HF libraries configure their root logger here


def _logging_to(handler: logging.Handler) -> Callable[[], None]:
    """Peer loggers to the file; returns the undo. A logger its library set up again inside the block (its handlers
    no longer the file's alone) keeps that set-up, less the file's handler."""
    _prime()
    saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
    names = set(PEERS) | {n for n, lg in logging.root.manager.loggerDict.items()
                          if n.split(".", 1)[0] in PEERS and isinstance(lg, logging.Logger) and lg.handlers}
    for name in sorted(names):
        lg = logging.getLogger(name)
        saved.append((lg, list(lg.handlers), lg.propagate))
        lg.handlers = [handler]
        lg.propagate = False
    last = logging.lastResort
    logging.lastResort = _Resort(handler, last)

    def undo() -> None:
        logging.lastResort = last
        for lg, hs, prop in reversed(saved):
            if lg.handlers == [handler]:
                lg.handlers = hs
                lg.propagate = prop
            elif handler in lg.handlers:
                lg.removeHandler(handler)

    return undo


def _loguru_to(out: _Line) -> Callable[[], None]:
    """loguru's records from peer modules to the file, hidden from its other handlers; returns the undo.

    loguru has no public way to change a handler's filter, so each other handler's `_filter` (0.7's attribute) is
    wrapped and put back; where it is not there, the records still go to the file (and to those handlers too)."""
    if "loguru" not in sys.modules and importlib.util.find_spec("loguru") is None:
        return lambda: None
    from loguru import logger

    def peer(record: dict[str, Any]) -> bool:
        return is_peer(record.get("name"))

    wrapped: list[tuple[Any, Any]] = []
    core = getattr(logger, "_core", None)
    for h in list(getattr(core, "handlers", {}).values()):
        if not hasattr(h, "_filter"):
            continue
        old = h._filter
        h._filter = (lambda r, old=old: not peer(r) and (old is None or old(r)))
        wrapped.append((h, old))
    level = min((int(getattr(h, "levelno", logging.DEBUG)) for h, _ in wrapped), default=logging.DEBUG)
    hid = logger.add(out.write, level=level, filter=peer, colorize=False, catch=True,
                     format="{time:YYYY-MM-DD HH:mm:ss,SSS} {level} {name}: {message}")

    def undo() -> None:
        logger.remove(hid)
        for h, old in reversed(wrapped):
            h._filter = old

    return undo


def _warnings_to(handler: logging.Handler) -> Callable[[], None]:
    """`warnings.showwarning` to the file, as `py.warnings` records; returns the undo."""
    saved = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        text = " ".join(str(message).split())
        handler.handle(logging.makeLogRecord({"name": "py.warnings", "levelno": logging.WARNING,
                                              "levelname": "WARNING",
                                              "msg": f"{category.__name__}: {text} ({filename}:{lineno})"}))

    warnings.showwarning = show

    def undo() -> None:
        warnings.showwarning = saved

    return undo


def _module(name: str) -> Any:
    """An installed peer's module (imported: the stage imports it anyway), or None."""
    try:
        if name in sys.modules or importlib.util.find_spec(name.split(".", 1)[0]) is not None:
            return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a peer that does not import has no progress bars to switch off
        return None
    return None


def _bars_off() -> Callable[[], None]:
    """datasets', transformers' and huggingface_hub's progress bars off; returns the undo (their states as found)."""
    hub = _module("huggingface_hub.utils.tqdm")
    ds = _module("datasets.utils.tqdm")
    tf = _module("transformers.utils.logging")
    hub_states = dict(hub.progress_bar_states) if hub is not None else None
    ds_off = ds.are_progress_bars_disabled() if ds is not None else None
    tf_on = tf.is_progress_bar_enabled() if tf is not None else None
    # (where HF_DATASETS/HF_HUB_DISABLE_PROGRESS_BARS=0 is set, the switch warns, into the file, and leaves them on;
    # no warnings.catch_warnings here: it would reset the once-per-place registries)
    if ds is not None and not ds_off:
        ds.disable_progress_bars()
    if tf is not None and tf_on:
        tf.disable_progress_bar()  # also huggingface_hub's global switch
    if hub is not None:
        hub.disable_progress_bars()

    def undo() -> None:
        if ds is not None and not ds_off:
            ds.enable_progress_bars()
        if tf is not None and tf_on:
            tf.enable_progress_bar()
        if hub is not None:  # the groups' states exactly as found (transformers' switch sets the global one only)
            hub.progress_bar_states.clear()
            hub.progress_bar_states.update(hub_states)

    return undo


@contextlib.contextmanager
def peers_to_log(path: Path | str) -> Iterator[Path]:
    """Within the block, the peer libraries' logging, loguru records, warnings and progress bars go to `path`
    (appended; its folder made); everything is put back on exit, an exception included, which leaves unchanged.
    Yields the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f, contextlib.ExitStack() as undo:
        out = _Line(f)
        handler = _handler(out)
        undo.callback(_warnings_to(handler))  # first: what the switches below warn lands in the file
        undo.callback(_logging_to(handler))
        undo.callback(_loguru_to(out))
        undo.callback(_bars_off())
        yield path
