"""A stage whose kernel is killed says why (issue 59): the signal, that the out-of-memory killer is the usual
sender of SIGKILL, the kernel's last measured memory and the setting that bounds the stage, in one line,
instead of nbclient's `DeadKernelError: Kernel died`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from loopback import LoopbackServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "EAGLE3DATA_TEST_KEY"
pytestmark = pytest.mark.slow


def _kernel_of(proc: subprocess.Popen, timeout: float = 120) -> psutil.Process:
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        for c in psutil.Process(proc.pid).children(recursive=True):
            try:
                if any("ipykernel" in a for a in c.cmdline()):
                    return c
            except psutil.Error:
                pass
        time.sleep(0.1)
    raise AssertionError("no kernel started")


def test_a_killed_kernel_is_named_with_its_signal_memory_and_setting(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"sample_id": i, "messages": [
        {"role": "user", "content": f"Question {i}"}]}) + b"\n" for i in range(40)))
    with LoopbackServer("openai", latency=30.0) as srv:  # every answer waits: the kernel is busy when killed
        o = {"output_root": str(tmp_path / "out"), "run_name": "run",
             "datasets": [{"name": "d0", "path": str(prompts)}], "generate.backend": "openai",
             "generate.concurrency": 4, "generate.timeout_s": 60,
             "generate.openai": {"base_url": srv.base_url, "model": "m", "api_key_env": KEY_ENV}}
        args = ["params/ci.yaml"]
        for k, v in o.items():
            args += ["-p", k, v if isinstance(v, str) else orjson.dumps(v).decode()]
        env = {**os.environ, KEY_ENV: "sk-loopback", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "eagle3data", "run", *args, "--only", "01"], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        kernel = _kernel_of(proc)
        while not srv.requests:  # the stage is at work: its memory has been measured by then (every 0.5 s)
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.5)
        kernel.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0 and proc.returncode != 3
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    line = lines[0]
    assert f"01_generate's kernel (pid {kernel.pid}) died: killed by SIGKILL" in line, line
    assert "out-of-memory killer is the usual sender of SIGKILL" in line
    assert "GiB" in line and "memory last measured" in line
    assert "the setting that bounds it: generate.concurrency" in line
    assert "DeadKernelError" not in line and "Traceback" not in err


def test_kernel_death_is_none_for_other_errors():
    from eagle3data.headless import kernel_death

    assert kernel_death("02_reconstruct", ValueError("x")) is None
