"""`python -m eagle3data run ... --only 01` under papermill against the loopback OpenRouter server.

Ctrl-C (SIGINT) and SIGTERM stop like headless generate: dispatch stops, the requests in
flight finish and are journaled, the ledger is final with its stop reason, exit 3 with one
line saying how to resume, no traceback; a second SIGINT cancels what is in flight; the
resume completes. The progress line reaches stdout while 01 runs inside papermill.
`status` and `stop` work from another process. Every user error is one line and a
non-zero exit; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from loopback import LoopbackServer  # noqa: E402
from runfiles import assert_ledger_adds_up, wait_lines  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "EAGLE3DATA_TEST_KEY"
pytestmark = pytest.mark.slow


def _prompts(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"sample_id": i, "messages": [
        {"role": "user", "content": f"Question {i}: how do we compute this?"}]}) + b"\n" for i in range(n)))
    return path


def _args(tmp_path: Path, srv: LoopbackServer, n: int, **extra) -> list[str]:
    o = {"output_root": str(tmp_path / "out"), "run_name": "run",
         "datasets": [{"name": "d0", "path": str(_prompts(tmp_path / "p.jsonl", n))}],
         "generate.backend": "openai", "generate.concurrency": 4, "generate.timeout_s": 30,
         "generate.ledger_interval_s": 0.05, "generate.stop_grace_s": 60,
         "generate.openai": {"base_url": srv.base_url, "model": "m", "api_key_env": KEY_ENV}}
    o.update(extra)
    args = ["params/ci.yaml"]
    for k, v in o.items():
        args += ["-p", k, v if isinstance(v, str) else orjson.dumps(v).decode()]
    return args + ["--only", "01"]


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    e = {**os.environ, KEY_ENV: "sk-loopback", "PYTHONUNBUFFERED": "1"}
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "eagle3data", *args], cwd=REPO, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    p = _cli(*args, env=env)
    out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _wait_status(run_dir: Path, status: str, proc: subprocess.Popen) -> None:
    while True:
        led = run_dir / "ledger.json"
        if led.exists() and f'"status": "{status}"'.encode() in led.read_bytes():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)


def _records(run_dir: Path) -> list[dict]:
    from eagle3data.core.records import scan_journal

    return scan_journal(run_dir / "records" / "d0.jsonl").records


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_run_stops_gracefully_and_resume_completes(tmp_path, sig):
    n = 80
    with LoopbackServer("openai", latency=0.6) as srv:
        args = _args(tmp_path, srv, n)
        run_dir = tmp_path / "out" / "run"
        proc = _cli("run", *args, "--progress-every", "0.2")
        wait_lines(run_dir / "records" / "d0.jsonl", 4, proc)
        proc.send_signal(sig)
        out, err = proc.communicate()
        answered = srv.served
    assert proc.returncode == 3, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "ZMQError" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped: ") and sig.name in last and "Resume: python -m eagle3data run params/ci.yaml" in last
    assert len(err.strip().splitlines()) == 1, err  # the one line, nothing else
    assert "    generate " in out and "req/s" in out and "elapsed" in out  # the live line, read from stdout
    recs = _records(run_dir)
    assert len(recs) == answered  # every response the server answered was journaled
    led = assert_ledger_adds_up(run_dir)
    d = led["datasets"]["d0"]
    assert led["status"] == "stopped" and sig.name in led["stop_reason"]
    assert d["cancelled"] == 0 and d["done"] == len(recs) < n
    assert (run_dir / "notebooks" / "01_generate.ipynb").exists() and not (run_dir / "STOP").exists()
    assert not (run_dir / "stage_times.json").exists()  # a stopped stage has no time of a completed run

    with LoopbackServer("openai") as srv:  # resume: a new server on a new port, the rest of the prompts
        res = _run("run", *_args(tmp_path, srv, n))
    assert res.returncode == 0, res.stderr
    took = json.loads((run_dir / "stage_times.json").read_text())["01_generate"]
    assert f" done in {took} s -> " in res.stdout  # the time README's make-run section shows, as printed
    recs = _records(run_dir)
    assert sorted(r["sample_id"] for r in recs) == list(range(n))  # every sample exactly once
    led = assert_ledger_adds_up(run_dir)
    assert led["status"] == "finished" and led["datasets"]["d0"]["done"] == n


def test_second_sigint_cancels_in_flight(tmp_path):
    with LoopbackServer("openai", latency=4.0) as srv:
        run_dir = tmp_path / "out" / "run"
        proc = _cli("run", *_args(tmp_path, srv, 60))
        wait_lines(run_dir / "records" / "d0.jsonl", 4, proc)
        proc.send_signal(signal.SIGINT)
        _wait_status(run_dir, "stopping", proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate()
    assert proc.returncode == 3, (out, err)
    assert "Traceback" not in err and "second SIGINT" in err
    led = assert_ledger_adds_up(run_dir)
    d = led["datasets"]["d0"]
    assert led["status"] == "cancelled" and "second SIGINT" in led["stop_reason"]
    assert d["cancelled"] > 0 and d["done"] == len(_records(run_dir))
    assert not set(d["cancelled_ids"]) & {r["sample_id"] for r in _records(run_dir)}


def test_status_and_stop_from_another_terminal(tmp_path):
    with LoopbackServer("openai", latency=0.6) as srv:
        run_dir = tmp_path / "out" / "run"
        proc = _cli("run", *_args(tmp_path, srv, 80))
        wait_lines(run_dir / "records" / "d0.jsonl", 4, proc)
        st = _run("status", str(run_dir))
        assert st.returncode == 0 and "RUNNING (01_generate" in st.stdout, st
        assert "progress (01_generate" in st.stdout and "planned" in st.stdout  # the line and the ledger table
        sp = _run("stop", str(run_dir))
        assert sp.returncode == 0 and "STOP" in sp.stdout, sp
        out, err = proc.communicate()
        answered = srv.served
    assert proc.returncode == 3, (out, err)
    assert "eagle3data stop" in err and "Traceback" not in err
    led = assert_ledger_adds_up(run_dir)
    assert led["status"] == "stopped" and "eagle3data stop" in led["stop_reason"]
    assert len(_records(run_dir)) == answered
    st = _run("status", str(run_dir))
    assert st.returncode == 0 and "not running" in st.stdout and "'stopped'" in st.stdout


@pytest.mark.parametrize("case, extra, env, words", [
    ("missing key", {}, {KEY_ENV: ""}, [KEY_ENV, "generate.openai.api_key_env", "not set"]),
    ("missing model folder", {"model.path": "/nonexistent/Kimi-K2.5"}, {}, ["model.path", "/nonexistent/Kimi-K2.5"]),
    ("index past a list", {"datasets.9.limit": 3}, {}, ["datasets.9.limit", "has 1 item", "no index 9"]),
    ("list item by a missing name", {"datasets.my_set.limit": 1}, {}, ["datasets.my_set.limit", "my_set", "d0"]),
    ("through a scalar", {"run_name.x": 1}, {}, ["run_name.x", "run_name", "str"]),
])
def test_user_errors_are_one_line(tmp_path, case, extra, env, words):
    with LoopbackServer("openai") as srv:
        res = _run("run", *_args(tmp_path, srv, 3, **extra), env=env)
    assert res.returncode == 2, (case, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, res.stderr)
    for w in words:
        assert w in lines[0], (case, w, lines[0])
    assert not (tmp_path / "out" / "run" / "records").exists()  # caught before any work


def test_dataset_by_name_override_and_debug_traceback(tmp_path):
    from eagle3data.core.params import load_params

    p = load_params(REPO / "params" / "ci.yaml", {"datasets.b5_openthoughts.limit": 1})
    assert [(d.name, d.limit) for d in p.datasets] == [("b1_glaive", 2), ("b5_openthoughts", 1)]
    res = _run("--debug", "run", "params/ci.yaml", "-p", "run_name.x", "1")
    assert res.returncode != 0 and "Traceback" in res.stderr and "run_name.x" in res.stderr
    res = _run("run", "params/ci.yaml", "-p", "run_name.x", "1", "--debug")
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_headless_generate_missing_model_folder_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "eagle3data", "generate", "params/ci.yaml", "-p", "model.path",
                          "/nonexistent/model", "-p", "output_root", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == ["error: model.path: model folder not found: /nonexistent/model"]


@pytest.mark.parametrize("case, content, words", [
    ("missing file", None, ["datasets.0 (d0, format prompts)", "prompt file not found", "nope.jsonl"]),
    ("empty file", b"", ["datasets.0 (d0, format prompts)", "the file is empty"]),
    ("parquet named .jsonl", b"PAR1\x00\x00\x00\x00PAR1", ["datasets.0 (d0, format prompts)", "parquet"]),
])
def test_bad_prompt_file_is_one_line_before_any_notebook(tmp_path, case, content, words):
    """`run --only 01` checks each prompt file against its format first: one line, exit 2, no notebook started."""
    path = tmp_path / "nope.jsonl"
    if content is not None:
        path.write_bytes(content)
    with LoopbackServer("openai") as srv:
        res = _run("run", *_args(tmp_path, srv, 3, datasets=[{"name": "d0", "path": str(path)}]))
    assert res.returncode == 2, (case, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, (case, res.stderr)
    for w in words:
        assert w in lines[0], (case, w, lines[0])
    assert not (tmp_path / "out" / "run" / "notebooks").exists()  # no stage started
    assert not (tmp_path / "out" / "run" / "records").exists()


def test_ready_problems_lists_every_bad_prompt_file(tmp_path):
    """One problem per bad dataset (joined into the one error line), none for a good file or without 01."""
    from eagle3data.preflight import ready_problems
    from eagle3data.core.params import load_params

    good = _prompts(tmp_path / "good.jsonl", 2)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    p = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path / "out"), "datasets": orjson.dumps([
        {"name": "a", "path": str(good)}, {"name": "b", "path": str(tmp_path / "empty.jsonl")},
        {"name": "c", "path": str(tmp_path / "missing.jsonl")}]).decode()})
    probs = ready_problems(p, ["01_generate"])
    assert [x.split(" ", 1)[0] for x in probs] == ["datasets.1", "datasets.2"], probs
    assert "empty" in probs[0] and "missing.jsonl" in probs[1]
    assert ready_problems(p, ["03_audit"]) == []  # later stages do not read the prompt files


def test_rejected_prompt_lines_reach_the_terminal_after_01(tmp_path, monkeypatch, capsys):
    """After 01 under `run`, each dataset's rejected-prompt count and its first 3 lines go to stdout."""
    from eagle3data import cli
    from eagle3data.generate.run import run_generate
    from eagle3data.headless import rejected_prompt_report
    from eagle3data.core.params import load_params

    good = [orjson.dumps({"sample_id": i, "messages": [{"role": "user", "content": f"Q {i}?"}]}) for i in range(4)]
    bad = [b'{"sample_id": 10}', b"not json at all", b'{"sample_id": 11, "messages": "x"}', b'{"sample_id": 12}']
    prompts = tmp_path / "with_bad_rows.jsonl"
    prompts.write_bytes(b"\n".join(good[:2] + bad + good[2:]) + b"\n")
    ran = []

    def headless_01(stage, params_file, overrides, out_dir):  # the stage's work without the papermill kernel
        ran.append(stage)
        run_generate(load_params(params_file, overrides), progress=False)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{stage}.html").write_text("<html></html>")
        return out_dir / f"{stage}.ipynb"

    monkeypatch.setattr(cli, "execute_notebook", headless_01)
    monkeypatch.setenv(KEY_ENV, "sk-loopback")
    with LoopbackServer("openai") as srv:
        args = _args(tmp_path, srv, 0, datasets=[{"name": "d0", "path": str(prompts), "max_rejected_share": 0.9}])
        rc = cli.main(["run", *args])
    out, err = capsys.readouterr()
    assert rc == 0 and ran == ["01_generate"], (out, err)
    led = orjson.loads((tmp_path / "out" / "run" / "ledger.json").read_bytes())
    rej = led["datasets"]["d0"]["rejected_prompt_lines"]
    assert len(rej) == 4 and led["datasets"]["d0"]["done"] == 4
    lines = out.splitlines()
    i = next(k for k, x in enumerate(lines) if "d0: 4 prompt line(s) rejected" in x)
    assert lines[i + 1:i + 4] == [f"    {x}" for x in rej[:3]]  # the first three, as the ledger has them
    assert "1 more" in lines[i + 4] and "ledger.json" in lines[i + 4]
    assert rejected_prompt_report(tmp_path / "nowhere") == []  # no ledger: nothing to say


def test_kernel_process_stderr_goes_to_the_stage_log(tmp_path, capfd):
    """What the kernel's process writes on its own stderr (here: a child process standing in for it, writing
    what a dying zmq thread prints after a stop) goes to the stage's log beside its notebook, never to the
    terminal of `eagle3data run`; the terminal's stderr is back afterwards; a failure names the log only when
    it holds more than the kernel's start-up warning."""
    from eagle3data.headless import KERNEL_NOISE, _kernel_stderr_to, _log_has_news

    log = tmp_path / "01_generate.stderr.log"
    with _kernel_stderr_to(log):
        subprocess.run([sys.executable, "-c", f"import sys; sys.stderr.write({KERNEL_NOISE[0]!r} + '\\n')"],
                       check=True)
    assert not _log_has_news(log)
    with _kernel_stderr_to(log):
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('Exception in thread Heartbeat:\\n"
                        "Traceback (most recent call last):\\nzmq.error.ContextTerminated\\n')"], check=True)
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert "Traceback" not in err and KERNEL_NOISE[0] not in err and err.strip() == "after"
    text = log.read_text()
    assert KERNEL_NOISE[0] in text and "Exception in thread Heartbeat" in text and _log_has_news(log)


def _extract_env() -> dict:
    """One worker: no RANK/WORLD_SIZE from a surrounding torchrun."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def test_extract_runs_04_headless_and_merges_the_index(ci_run, tmp_path):
    """`python -m eagle3data extract PARAMS` on a copy of the ci run: 04 without papermill, exit 0, the index
    merged and valid; `--merge-only` merges it again from the shards."""
    from eagle3data.core.params import load_params
    from eagle3data.hidden.mix import hidden_dir
    from eagle3data.hidden.store.format import INDEX_FILE

    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    over = ["-p", "output_root", str(tmp_path), "-p", "hidden.probe_batches", "0"]
    res = subprocess.run([sys.executable, "-m", "eagle3data", "extract", "params/ci.yaml", *over], cwd=REPO,
                         env=_extract_env(), capture_output=True, text=True)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stdout.strip().splitlines()
    stats = orjson.loads(next(x for x in lines if x.startswith('{"rank"')))
    assert stats["rank"] == 0 and stats["extracted"] > 0
    assert lines[-1].startswith("index merged: ") and lines[-1].endswith("validation problems: 0"), lines
    params = load_params(REPO / "params" / "ci.yaml", {"output_root": str(tmp_path)})
    assert (hidden_dir(params) / INDEX_FILE).exists()
    res = subprocess.run([sys.executable, "-m", "eagle3data", "extract", "params/ci.yaml", *over, "--merge-only"],
                         cwd=REPO, env=_extract_env(), capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith(f"index: {stats['extracted']} samples"), (res.stdout, res.stderr)


@pytest.mark.parametrize("case, args", [
    ("merge-only without 04", ["--merge-only"]),
    ("bad param", ["-p", "run_name.x", "1"]),
])
def test_extract_user_errors_are_one_line(ci_run, tmp_path, case, args):
    """`extract --merge-only` on a run that 04 never ran on, or a bad param: one line on stderr, exit 2."""
    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    res = subprocess.run([sys.executable, "-m", "eagle3data", "extract", "params/ci.yaml", "-p", "output_root",
                          str(tmp_path), *args], cwd=REPO, env=_extract_env(), capture_output=True, text=True)
    assert res.returncode == 2, (case, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, (case, res.stderr)


def test_help_lists_every_subcommand():
    """`python -m eagle3data --help` is the one command line: every subcommand, `extract` included."""
    from eagle3data.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = set(sub.choices)
    assert {"run", "status", "stop", "generate", "extract", "audit", "export", "prompts", "prepare-model"} <= names
    res = _run("--help")
    assert res.returncode == 0
    for name in names:
        assert f"    {name} " in res.stdout, (name, res.stdout)


def test_a_head_position_cap_below_the_floors_is_one_line_before_any_stage(tmp_path):
    """04's own verification cannot judge at fewer positions than its floors (false failures), so such a
    `hidden.verify_positions` is a params error: `run` and `extract` refuse it before any work, one line naming the key,
    exit 2."""
    for cmd in ("run", "extract"):
        res = subprocess.run([sys.executable, "-m", "eagle3data", cmd, "params/ci.yaml", "-p", "hidden.verify_positions",
                              "8", "-p", "output_root", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (cmd, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: invalid params in ") and lines[0].endswith(
            "`hidden.verify_positions`: Value error, must be 0 (every position) or at least 64 (the floors the logit-z "
            "limits were measured at: fewer positions fail clean samples)"), (cmd, lines)
        assert not (tmp_path / "ci").exists()  # nothing started
