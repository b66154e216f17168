"""Read-ahead of store files (core/readahead): the whole file is asked for, in steps the kernel honours, off the
reader's thread. Linux reads at most the device's read-ahead window (128 KiB here) per POSIX_FADV_WILLNEED call,
so the one whole-file call this replaced warmed only a shard's first 128 KiB."""

from __future__ import annotations

import os
import threading

import pytest

from eagle3data.core import readahead

pytestmark = pytest.mark.skipif(not hasattr(os, "POSIX_FADV_WILLNEED"), reason="no posix_fadvise on this platform")


def _recording(monkeypatch) -> list[tuple]:
    calls: list[tuple] = []
    real = os.posix_fadvise

    def rec(fd, offset, length, advice):
        calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length, advice,
                      threading.get_ident()))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", rec)
    return calls


def test_will_need_asks_for_every_step_of_each_file_in_order_on_another_thread(tmp_path, monkeypatch):
    step = readahead.WILLNEED_STEP
    a, b = tmp_path / "r000-00000.safetensors", tmp_path / "r000-00001.safetensors"
    a.write_bytes(os.urandom(2 * step + 1))  # three steps, the last of one byte
    b.write_bytes(os.urandom(step // 2))
    calls = _recording(monkeypatch)
    readahead.will_need(a, b).result()
    assert [(f, at, n, adv) for f, at, n, adv, _ in calls] == [
        (a.name, 0, step, os.POSIX_FADV_WILLNEED), (a.name, step, step, os.POSIX_FADV_WILLNEED),
        (a.name, 2 * step, step, os.POSIX_FADV_WILLNEED), (b.name, 0, step, os.POSIX_FADV_WILLNEED)]
    assert {t for *_, t in calls} != {threading.get_ident()}  # the reader's thread goes on while the disk reads


def test_eviction_is_one_call_per_file_and_a_missing_file_is_skipped(tmp_path, monkeypatch):
    f = tmp_path / "hs_0.safetensors"
    f.write_bytes(os.urandom(3 * readahead.WILLNEED_STEP))
    calls = _recording(monkeypatch)
    readahead.advise(os.POSIX_FADV_DONTNEED, tmp_path / "gone.safetensors", f)
    assert [(n, at, ln, adv) for n, at, ln, adv, _ in calls] == [(f.name, 0, 0, os.POSIX_FADV_DONTNEED)]
    assert readahead.will_need() is None
