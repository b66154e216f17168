"""`core.peer_logs.peers_to_log`: the peer libraries' logging, loguru lines, warnings and progress bars go to the run's
log file while the stage's own lines still reach the user; everything is put back after, an exception included; and
06's real training (speculators' draft, a step on the ci hand-off) leaves nothing of the peers' on stderr.
"""

from __future__ import annotations

import importlib
import io
import logging
import sys
import warnings

import pytest

from eagle3data.core.peer_logs import PEERS, peers_to_log


def _bar_modules() -> tuple:
    """datasets', huggingface_hub's progress-bar modules (`import a.utils.tqdm` names their tqdm class) and
    transformers' logging module."""
    return tuple(importlib.import_module(m) for m in ("datasets.utils.tqdm", "huggingface_hub.utils.tqdm",
                                                      "transformers.utils.logging"))


def _state() -> dict:
    """The global switches peers_to_log changes."""
    from loguru import logger

    ds_tqdm, hub_tqdm, tf_logging = _bar_modules()

    loggers = {n: (tuple(lg.handlers), lg.propagate, lg.level, lg.disabled)
               for n, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return {"showwarning": warnings.showwarning, "filters": list(warnings.filters), "last_resort": logging.lastResort,
            "root": (tuple(logging.root.handlers), logging.root.level), "loggers": loggers,
            "loguru": {i: h._filter for i, h in logger._core.handlers.items()},
            "bars": (ds_tqdm.are_progress_bars_disabled(), tf_logging.is_progress_bar_enabled(),
                     dict(hub_tqdm.progress_bar_states)),
            "streams": (sys.stdout, sys.stderr)}


def _same(before: dict, after: dict) -> None:
    for k, v in before.items():
        if k == "loggers":  # a peer's top-level logger the block made is new: no handler, propagating
            for n, lg in after[k].items():
                assert v.get(n, ((), True, logging.NOTSET, False)) == lg, n
        else:
            assert after[k] == v, k


def test_peer_lines_go_to_the_file_and_the_stages_own_lines_to_the_user(tmp_path, capfd, caplog):
    from loguru import logger

    mine = io.StringIO()  # a loguru handler of the user's (the default one holds the stderr of its import)
    hid = logger.add(mine, format="{name}: {message}")
    log = tmp_path / "logs" / "peers.log"
    try:
        before = _state()
        with peers_to_log(log) as path:
            assert path == log
            logging.getLogger("speculators.train.data").warning("no handler of its own: %s", "lastResort's")
            logging.getLogger("transformers.modeling_utils").error("transformers' own stderr handler")
            logging.getLogger("torch.distributed").warning("torch's own stderr handler")
            warnings.warn("`past_key_values` is deprecated", FutureWarning)
            logger.patch(lambda r: r.update(name="speculators.utils.loading")).warning(
                "Tensor 'lm_head.weight' not found in weight_map.")
            logger.patch(lambda r: r.update(name="eagle3data.value.run")).warning("the project's loguru line")
            print("train 1/1 · loss 17.6", flush=True)  # the stage's say
            logging.getLogger("eagle3data.value").warning("the project's logging line")
        _same(before, _state())
        logging.getLogger("speculators.train.data").warning("after the block: stderr again")
    finally:
        logger.remove(hid)
    out, err = capfd.readouterr()
    text = log.read_text(encoding="utf-8")
    assert "train 1/1 · loss 17.6" in out
    for peer in ("lastResort's", "transformers' own", "torch's own", "past_key_values", "lm_head.weight"):
        assert peer in text and peer not in err + out + mine.getvalue() + caplog.text, peer
    # the root logger's handlers (here pytest's, else logging's last resort on stderr) get the rest, as before
    assert "after the block: stderr again" in caplog.text and "after the block" not in text
    assert "the project's logging line" in caplog.text and "the project's" not in text
    assert "the project's loguru line" in mine.getvalue()
    lines = text.splitlines()
    assert len(lines) == 5  # one line each, with the logger's name
    assert any(" WARNING speculators.train.data: no handler" in x for x in lines)
    assert any(" ERROR transformers.modeling_utils: " in x for x in lines)
    assert any(" WARNING torch.distributed: " in x for x in lines)
    assert any(" WARNING py.warnings: FutureWarning: `past_key_values` is deprecated (" in x for x in lines)
    assert any(" WARNING speculators.utils.loading: Tensor 'lm_head.weight'" in x for x in lines)


def test_with_no_logging_set_up_a_librarys_line_goes_to_the_file_and_the_projects_to_stderr(tmp_path, capfd,
                                                                                            monkeypatch):
    monkeypatch.setattr(logging.root, "handlers", [])  # a notebook's kernel: logging's last resort writes to stderr
    with peers_to_log(tmp_path / "peers.log"):
        logging.getLogger("somelib.client").warning("a library never configured")
        logging.getLogger("eagle3data.value").warning("the project's own line")
    err = capfd.readouterr().err
    text = (tmp_path / "peers.log").read_text()
    assert "WARNING somelib.client: a library never configured" in text and "never configured" not in err
    assert "the project's own line" in err and "the project's" not in text


def test_progress_bars_are_off_inside_and_as_they_were_after(tmp_path):
    ds_tqdm, hub_tqdm, tf_logging = _bar_modules()
    before = _state()
    with peers_to_log(tmp_path / "peers.log"):
        assert ds_tqdm.are_progress_bars_disabled() and not tf_logging.is_progress_bar_enabled()
        assert hub_tqdm.are_progress_bars_disabled()
    _same(before, _state())
    ds_tqdm.disable_progress_bars()  # and a state of the user's own is what comes back
    try:
        before = _state()
        with peers_to_log(tmp_path / "peers.log"):
            pass
        _same(before, _state())
    finally:
        ds_tqdm.enable_progress_bars()


def test_an_exception_leaves_the_block_unchanged_and_everything_is_put_back(tmp_path):
    before = _state()
    boom = RuntimeError("the peer failed")
    with pytest.raises(RuntimeError) as caught:
        with peers_to_log(tmp_path / "peers.log"):
            logging.getLogger("speculators").warning("before it failed")
            raise boom
    assert caught.value is boom and caught.value.__traceback__ is not None
    _same(before, _state())
    assert "before it failed" in (tmp_path / "peers.log").read_text()


def test_blocks_nest_and_each_line_goes_to_the_innermost_file(tmp_path):
    before = _state()
    with peers_to_log(tmp_path / "outer.log"):
        with peers_to_log(tmp_path / "inner.log"):
            logging.getLogger("datasets").warning("inner line")
        logging.getLogger("datasets").warning("outer line")
    _same(before, _state())
    assert (tmp_path / "inner.log").read_text().count("line") == 1
    assert "outer line" in (tmp_path / "outer.log").read_text()
    assert "speculators" in PEERS
