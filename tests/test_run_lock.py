"""One run, one writer: a second start on a live run folder refuses; a dead writer's lock is taken over;
the ranks of one launch share the folder; every file written gets the mode the umask gives.

The runs are the documented command (`python -m eagle3data run params/ci.yaml --only 01`) as
subprocesses against the loopback OpenRouter server, as in test_cli_run.py. "Refuses within
seconds" is asserted as: the second start exits 2 while the first is still running.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from loopback import LoopbackServer  # noqa: E402
from runfiles import assert_ledger_adds_up, wait_lines  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "EAGLE3DATA_TEST_KEY"
LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
               "EAGLE3DATA_LAUNCH")
pytestmark = pytest.mark.slow

# holds a run folder as a stage would, until the file named by argv[2] exists; exit 2 with the line when refused
HOLDER = """
import sys, time
from pathlib import Path
from eagle3data.core.runlock import RunFolderBusy, hold_run
try:
    with hold_run(Path(sys.argv[1]), "04_extract_hidden"):
        print("held", flush=True)
        while not Path(sys.argv[2]).exists():
            time.sleep(0.05)
except RunFolderBusy as e:
    print(e, file=sys.stderr)
    sys.exit(2)
"""


def _env(**extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    e.update({KEY_ENV: "sk-loopback", "PYTHONUNBUFFERED": "1"}, **extra)
    return e


def _args(tmp_path: Path, srv: LoopbackServer, n: int) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"sample_id": i, "messages": [
        {"role": "user", "content": f"Question {i}: how do we compute this?"}]}) + b"\n" for i in range(n)))
    o = {"output_root": str(tmp_path / "out"), "run_name": "run",
         "datasets": [{"name": "d0", "path": str(prompts)}],
         "generate.backend": "openai", "generate.concurrency": 4, "generate.timeout_s": 30,
         "generate.ledger_interval_s": 0.05,
         "generate.openai": {"base_url": srv.base_url, "model": "m", "api_key_env": KEY_ENV}}
    args = ["params/ci.yaml"]
    for k, v in o.items():
        args += ["-p", k, v if isinstance(v, str) else orjson.dumps(v).decode()]
    return args


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eagle3data", *args], cwd=REPO, env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(p: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _completed_keys(run_dir: Path) -> list[int]:
    from eagle3data.core.records import scan_journal

    return [r["sample_id"] for r in scan_journal(run_dir / "records" / "d0.jsonl").records]


def test_second_run_on_a_live_folder_refuses_and_the_first_completes(tmp_path):
    n = 40
    with LoopbackServer("openai", latency=1.0) as srv:
        args = _args(tmp_path, srv, n)
        run_dir = tmp_path / "out" / "run"
        first = _cli("run", *args, "--only", "01")
        wait_lines(run_dir / "records" / "d0.jsonl", 1, first)  # the first is at work
        second = _done(_cli("run", *args, "--only", "01"))
        assert first.poll() is None, "the first run ended before the second was refused"
        also = _done(_cli("generate", *args, "--quiet"))  # headless 01 on the same folder: the same refusal
        assert first.poll() is None
        res = _done(first)
    assert second.returncode == 2, (second.stdout, second.stderr)
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in second.stderr, second.stderr
    line = lines[0]
    for words in (f"{run_dir} is in use", "01_generate", f"pid {first.pid}", "on host ", "since ", " UTC",
                  "eagle3data run params/ci.yaml", "nothing was written",
                  f"`eagle3data status {run_dir}`", f"`eagle3data stop {run_dir}`"):
        assert words in line, (words, line)
    assert "run 'run'" not in second.stdout  # stopped before it started anything
    assert also.returncode == 2 and "is in use: 01_generate" in also.stderr, (also.stdout, also.stderr)
    assert res.returncode == 0, (res.stdout, res.stderr)
    keys = _completed_keys(run_dir)
    assert sorted(keys) == list(range(n))  # one completed line per key
    assert assert_ledger_adds_up(run_dir)["datasets"]["d0"]["done"] == n
    assert not (run_dir / "run.lock.json").exists()  # the folder is free again


def test_a_dead_writers_lock_is_taken_over_and_the_resumed_run_completes(tmp_path):
    n = 40
    with LoopbackServer("openai", latency=0.5) as srv:
        args = _args(tmp_path, srv, n)
        run_dir = tmp_path / "out" / "run"
        gen = _cli("generate", *args, "--quiet")  # headless 01: one process, killed as `kill -9` does
        wait_lines(run_dir / "records" / "d0.jsonl", 4, gen)
        gen.send_signal(signal.SIGKILL)
        gen.communicate()
        left = orjson.loads((run_dir / "run.lock.json").read_bytes())
        assert left["pid"] == gen.pid and left["stage"] == "01_generate"  # the dead writer's record is still there
        st = _done(_cli("status", str(run_dir)))
        assert st.returncode == 0 and "not running" in st.stdout, st.stdout
        res = _done(_cli("run", *args, "--only", "01"))
    assert res.returncode == 0, (res.stdout, res.stderr)
    took = [x for x in res.stdout.splitlines() if x.startswith("took over the lock")]
    assert len(took) == 1 and f"pid {gen.pid}" in took[0] and "its process is gone" in took[0], res.stdout
    assert sorted(_completed_keys(run_dir)) == list(range(n))  # resumed: every key once
    assert not (run_dir / "run.lock.json").exists()


def test_ranks_of_one_launch_are_not_refused_and_hold_it_until_the_last_ends(tmp_path):
    run_dir = tmp_path / "run"
    launch = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "WORLD_SIZE": "2"}

    def holder(go: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(tmp_path / go)], cwd=REPO,
                                env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    rank0 = holder("go0", **launch, RANK="0")
    assert rank0.stdout.readline().strip() == "held"
    rank1 = holder("go1", **launch, RANK="1")
    assert rank1.stdout.readline().strip() == "held", rank1.communicate()  # the same launch: not refused
    rec = orjson.loads((run_dir / "run.lock.json").read_bytes())
    assert rec["pid"] == rank0.pid and rec["rank"] == 0 and rec["launch"] == "torchrun none @ 127.0.0.1:29517"
    other = _done(holder("never", **{**launch, "MASTER_PORT": "29518"}, RANK="0"))  # another torchrun
    assert other.returncode == 2 and "is in use: 04_extract_hidden by pid" in other.stderr, other.stderr
    assert f"pid {rank0.pid}" in other.stderr and "rank 0" in other.stderr
    alone = _done(holder("never"))  # a process of no launch
    assert alone.returncode == 2 and "is in use" in alone.stderr
    (tmp_path / "go0").touch()  # rank 0 ends first: rank 1 still holds the folder
    assert rank0.wait() == 0
    again = _done(holder("never"))
    assert again.returncode == 2 and "that pid is gone; another process of its launch still holds the lock" in \
        again.stderr, again.stderr
    (tmp_path / "go1").touch()
    assert rank1.wait() == 0
    assert not (run_dir / "run.lock.json").exists()  # the last of the launch removed it
    (tmp_path / "go2").touch()
    assert _done(holder("go2")).returncode == 0  # free again


def test_status_reads_the_record_of_a_held_folder(tmp_path):
    """While a writer holds the folder, `status` reads its record (reading takes no lock)."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(tmp_path / "go")], cwd=REPO, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        (run_dir / "records").mkdir()
        st = _done(_cli("status", str(run_dir)))
        assert st.returncode == 0 and f"RUNNING (04_extract_hidden; process {p.pid} alive)" in st.stdout, st.stdout
    finally:
        (tmp_path / "go").touch()
        p.wait()


def _modes(root: Path) -> dict[str, int]:
    """Each file's mode; a link by the file it points at (SpecForge's `target/` links into the model cache)."""
    return {str(f.relative_to(root)): stat.S_IMODE(f.stat().st_mode) for f in root.rglob("*") if f.is_file()}


def test_shards_trainer_files_and_exports_follow_the_umask(ci_run, tmp_path):
    """Under umask 022, 04's shards and index, 05's per-sample trainer files (`hs_<i>.safetensors`, `.ckpt`),
    token files and draft vocabulary, and the model files `export/specforge/target/` links to, are all 0644
    (safetensors alone writes 0600)."""
    shutil.copytree(ci_run.run_dir / "records", tmp_path / "ci" / "records")
    env = _env()
    over = ["-p", "output_root", str(tmp_path), "-p", "hidden.probe_batches", "0"]
    res = subprocess.run([sys.executable, "-m", "eagle3data", "extract", "params/ci.yaml", *over], cwd=REPO, env=env,
                         capture_output=True, text=True, umask=0o022)
    assert res.returncode == 0, (res.stdout, res.stderr)
    for fmt in ("speculators", "specforge"):
        res = subprocess.run([sys.executable, "-m", "eagle3data", "export", str(tmp_path / "ci"), "--format", fmt,
                              "--out", str(tmp_path / "ci" / "export" / fmt)], cwd=REPO, env=env,
                             capture_output=True, text=True, umask=0o022)
        assert res.returncode == 0, (fmt, res.stdout, res.stderr)
    modes = _modes(tmp_path / "ci")
    assert any(k.startswith("export/specforge/target/") and (tmp_path / "ci" / k).is_symlink() for k in modes), sorted(modes)
    shards = [k for k in modes if k.endswith(".safetensors") and k.startswith("hidden")]
    hs = [k for k in modes if "/hs_" in k and k.endswith(".safetensors")]
    ckpt = [k for k in modes if k.endswith(".ckpt")]
    assert shards and hs and ckpt and any("draft_vocab" in k for k in modes), sorted(modes)
    wrong = {k: oct(m) for k, m in modes.items() if m != 0o644}
    assert not wrong, wrong


def test_the_model_cache_follows_the_umask(tmp_path):
    """Issue 43 item 5: `prepare-model` writes the converted model 0644 under umask 022 (save_pretrained's
    safetensors alone makes the weights 0600, and an export's `target/` links to them); a cache written
    0600 before this rule is mended the next time it is used."""
    env = _env(EAGLE3DATA_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-m", "eagle3data", "prepare-model"], cwd=REPO, env=env,
                         capture_output=True, text=True, umask=0o022)
    assert res.returncode == 0, (res.stdout, res.stderr)
    folder = Path(res.stdout.strip().splitlines()[-1])
    modes = _modes(tmp_path / "cache")
    assert "models/smollm2-135m-instruct/model.safetensors" in modes and folder.is_dir(), sorted(modes)
    assert not {k: oct(m) for k, m in modes.items() if m != 0o644}
    (folder / "model.safetensors").chmod(0o600)
    res = subprocess.run([sys.executable, "-m", "eagle3data", "prepare-model"], cwd=REPO, env=env,
                         capture_output=True, text=True, umask=0o022)
    assert res.returncode == 0 and stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644, res.stderr


def test_the_heads_cached_moments_follow_the_umask(tmp_path, monkeypatch):
    """verify-hidden keeps the head's vocabulary moments in the model cache (`.cache/head_moments/`): written with the
    umask's mode (safetensors alone made them 0600), and a file written before is mended when it is read."""
    import torch

    from eagle3data.hidden.verify.head import Head, moments_path

    monkeypatch.setenv("EAGLE3DATA_CACHE", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(0)
    head = lambda: Head(torch.ones(8), torch.randn(32, 8, generator=g), 1e-6, ("n", "h"), origin="test|h|1|2")  # noqa: E731
    old = os.umask(0o022)
    try:
        head().moments()
        path = moments_path("test|h|1|2")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 and [p.name for p in path.parent.iterdir()] == [path.name]
        path.chmod(0o600)
        head().moments()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_atomic_write_gives_the_umask_mode(tmp_path):
    """The one helper: whatever the writer creates (safetensors makes 0600), the file ends with 0666 less the umask."""
    import torch
    from safetensors.torch import save_file

    from eagle3data.core.atomic import atomic_path, umask_mode, write_atomic

    old = os.umask(0o027)
    try:
        assert umask_mode() == 0o640
        with atomic_path(tmp_path / "a.safetensors", fsync=True) as tmp:
            save_file({"x": torch.zeros(2)}, str(tmp))
        write_atomic(tmp_path / "b.json", b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.json"]  # no temp file left
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "c.bin") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert not (tmp_path / "c.bin").exists() and not (tmp_path / "c.bin.tmp").exists()


@pytest.mark.parametrize("command", [["export", "{run}", "--format", "specforge", "--out", "{out}"],
                                     ["verify-hidden", "{run}", "--out", "{out}"]])
def test_export_and_verify_hidden_refuse_a_folder_a_stage_is_writing(ci_run, tmp_path, command):
    """`export` reads the store a live 04 writes, `verify-hidden` writes beside it: both wait for the folder."""
    run_dir, out = tmp_path / "ci", tmp_path / "out"
    shutil.copytree(ci_run.run_dir, run_dir)
    args = [a.format(run=run_dir, out=out) for a in command]
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(tmp_path / "go")], cwd=REPO, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        r = _done(_cli(*args))
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert f"04_extract_hidden by pid {p.pid}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not out.exists()
    finally:
        (tmp_path / "go").touch()
        p.wait()
    after = _done(_cli(*args))  # released: the command runs (export: ids only; verify: no store to verify)
    assert "is in use" not in after.stderr, after.stderr
    assert out.exists() if command[0] == "export" else "no index" in after.stderr, (after.stdout, after.stderr)
    assert not (run_dir / "run.lock.json").exists()  # and it let the folder go


@pytest.mark.parametrize("command", [["export", "{run}", "--format", "specforge", "--out", "{out}"],
                                     ["verify-hidden", "{run}", "--out", "{out}"]])
def test_a_command_on_a_missing_run_folder_is_one_line_and_creates_nothing(tmp_path, command):
    """The run lock refuses the path (`hold_run(..., create=False)`): the commands have no pre-check of their own."""
    r = _done(_cli(*[a.format(run=tmp_path / "nope", out=tmp_path / "o") for a in command]))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope'}: no such run folder (outputs/<run>)"], r.stderr
    assert not (tmp_path / "nope").exists() and not (tmp_path / "o").exists()


def test_export_of_a_folder_that_is_no_run_is_its_own_line_and_leaves_no_lock(tmp_path):
    (tmp_path / "notarun").mkdir()
    r = _done(_cli("export", str(tmp_path / "notarun"), "--format", "specforge", "--out", str(tmp_path / "o")))
    assert r.returncode == 2 and "no records/ folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert list((tmp_path / "notarun").iterdir()) == []  # the lock taken for the command is gone with it


def test_hold_run_makes_the_folder_unless_told_it_must_exist(tmp_path):
    from eagle3data.core.runlock import RunFolderMissing, hold_run

    with pytest.raises(RunFolderMissing, match="no such run folder"):
        hold_run(tmp_path / "typo", "05_export", create=False)
    assert not (tmp_path / "typo").exists()
    with hold_run(tmp_path / "new", "01_generate"):
        assert (tmp_path / "new").is_dir()
    (tmp_path / "old").mkdir()
    with hold_run(tmp_path / "old", "05_export", create=False) as lock:
        assert lock.path.exists()
