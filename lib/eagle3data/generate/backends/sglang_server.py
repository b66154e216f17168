"""An SGLang server started on this machine for a stage (01 `generate.sglang.launch`, 04 `hidden.sglang.launch`).

`sglang_command(params, s, stage=...)` builds the exact command line from params: the SGLang venv's
Python (`make sglang`, `.sglang/`) running `-m sglang.launch_server` on the model folder, with the
served name (params' model name), dtype, context length, tensor parallel size, the radix cache as the
stage needs it (04: off, or the prefill rows of a prompt sharing a prefix with an earlier one are
missing), chunked prefill as the stage needs it (04: off, or a prompt split over chunks returns its last chunk's
states only), plus what the stage adds (04: the hidden-states flags). Where `model.device` is `cpu` it adds
what SGLang's CPU path needs (engines/README.md): `SGLANG_USE_CPU_ENGINE=1`, `--device cpu
--attention-backend torch_native --sampling-backend pytorch --disable-cuda-graph --grammar-backend none
--skip-server-warmup` and a KV cache of `max_total_tokens` (8192 unless set: SGLang would size it from
the free memory). The server itself is `vllm_server.VLLMServer`'s lifecycle (own session, the launcher's
death signal, the pid record, `/health`, the process group stopped at the end) under SGLang's name, and
it fails fast with the log's tail when the scheduler dies before `/health` answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3data.core.params import RunParams, repo_root
from eagle3data.generate.backends.vllm_server import EngineCommand, VLLMServer, free_port, model_dir

LAUNCH = "sglang.launch_server"
CPU_KV_TOKENS = 8192  # KV cache tokens on CPU when server.max_total_tokens is unset
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--grammar-backend", "none", "--skip-server-warmup"]
CHUNKED_PREFILL_OFF = ["--chunked-prefill-size", "-1"]  # 04's servers: one forward per prompt (sglang_capture.py)
SCHEDULER_DIED = ("Scheduler hit an exception", "SIGQUIT received")  # log lines of a server that will never answer


def sglang_python(s: Any) -> str:
    """The SGLang venv's Python (relative paths from the repository root)."""
    p = Path(s.server.python).expanduser()
    return str(p if p.is_absolute() else repo_root() / p)


def sglang_command(params: RunParams, s: Any, *, stage: str, radix_cache: bool | None = None,
                   chunked_prefill: bool = True, extra_args: list[str] | None = None) -> EngineCommand:
    """The exact command that serves params' model with `s.server`'s settings (plus a stage's own flags);
    `chunked_prefill=False` (04) adds `--chunked-prefill-size -1`: a chunked prompt's hidden states come back for
    its last chunk only."""
    srv, m = s.server, params.model
    port = srv.port or free_port(srv.host)
    argv = [sglang_python(s), "-m", LAUNCH, "--model-path", model_dir(params), "--served-model-name", m.name,
            "--host", srv.host, "--port", str(port), "--dtype", srv.dtype or m.dtype,
            "--tp-size", str(srv.tensor_parallel_size)]
    if m.tokenizer_path:
        argv += ["--tokenizer-path", m.tokenizer_path]
    if m.trust_remote_code:
        argv.append("--trust-remote-code")
    if srv.context_length or m.max_context:
        argv += ["--context-length", str(srv.context_length or m.max_context)]
    env: dict[str, str] = {}
    cpu = m.device == "cpu"
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        argv += CPU_FLAGS
    kv = srv.max_total_tokens or (CPU_KV_TOKENS if cpu else None)
    if kv:
        argv += ["--max-total-tokens", str(kv)]
    if srv.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", f"{srv.mem_fraction_static:g}"]
    if not chunked_prefill:
        argv += CHUNKED_PREFILL_OFF
        if cpu and kv:  # without chunks SGLang reserves max_prefill_tokens (16384) x 1.5 MB of activations out of the
            argv += ["--max-prefill-tokens", str(kv)]  # machine's memory (23 GB here: none left); a batch <= the pool
    if not (srv.radix_cache if radix_cache is None else radix_cache):
        argv.append("--disable-radix-cache")
    argv += [*(extra_args or []), *srv.extra_args]
    host = "127.0.0.1" if srv.host in ("0.0.0.0", "::") else srv.host
    return EngineCommand(argv, env, f"http://{host}:{port}", params.run_dir / "engine" / f"sglang_{stage}.log",
                         srv.start_timeout_s)


class SGLangServer(VLLMServer):
    """A started SGLang server (see `VLLMServer`): `with SGLangServer(cmd) as srv:`; leaving stops it."""

    engine = "SGLang"
    build_hint = "run `make sglang` (SGLang in its own venv, .sglang/), or set server.python"

    def start(self) -> "SGLangServer":
        try:  # the log is appended to: an earlier launch's shutdown (its own "SIGQUIT received") is not this one's
            self._log_from = self.cmd.log.stat().st_size
        except OSError:
            self._log_from = 0
        return super().start()

    def dead_reason(self) -> str | None:
        """A line of this launch's log saying the scheduler died (the API process may stay up and never answer
        /health)."""
        try:
            with open(self.cmd.log, "rb") as f:
                f.seek(getattr(self, "_log_from", 0))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return None
        return next((m for m in SCHEDULER_DIED if m in text), None)
