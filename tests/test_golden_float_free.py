"""The golden notebooks hold what the code decides, never a figure the CPU's floating-point unit computed.

The machines `make test` meets (CI's included) round float kernels differently in the last bits (an AMD EPYC
with AVX2, an Intel Xeon with AMX, a user's laptop): a golden holding a checksum of state bytes, a norm, a loss or
a KL passes on the machine that ran `make golden` and fails on the other. This test makes "another CPU" here:
the golden notebooks run again under nbval, in a pytest process of their own, with every float weight of the
target moved one ulp (tests/float_noise/sitecustomize.py), so every state 04 stores and 05 converts differs in
its last bits; nbval must still pass with the committed goldens and sanitize patterns. It then shows the
perturbation reached the stored bytes: the store's file checksums differ from an unperturbed run's (this
session's own run of the goldens when `make test` ran them before this file, else one more run here).

The Kimi audit reads no model and is left out; 01–03 run because 04 reads what they leave in the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDENS = ["01_generate", "02_reconstruct", "03_audit", "04_extract_hidden", "05_export"]
NOISE = REPO / "tests" / "float_noise"
SESSIONS = REPO / "outputs" / ".nbval"


def _run_goldens(direction: str | None) -> tuple[subprocess.CompletedProcess, Path]:
    """nbval on the goldens in a pytest process of its own (`direction`: the ulp nudge, None: none); its run folder."""
    env = dict(os.environ)
    env.pop("EAGLE3DATA_FLOAT_NOISE", None)
    if direction:
        env["EAGLE3DATA_FLOAT_NOISE"] = direction
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NOISE), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *[f"tests/golden/{g}.ipynb" for g in GOLDENS]]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate()
    # conftest's folder for that process (outputs/.nbval/session-<pid>/); kept until a later session starts
    return subprocess.CompletedProcess(cmd, proc.returncode, out), SESSIONS / f"session-{proc.pid}" / "nbval"


def _checksums(run: Path) -> dict[str, str]:
    index = run / "hidden" / "index.parquet"
    assert index.is_file(), f"{index}: the 04 golden wrote no index"
    df = pd.read_parquet(index, columns=["shard", "checksum"])
    return dict(zip(df["shard"], df["checksum"]))


@pytest.mark.slow
def test_goldens_pass_when_every_state_differs_in_its_last_bits():
    noisy, noisy_run = _run_goldens("up")
    assert noisy.returncode == 0, "a golden depends on float rounding (weights one ulp up):\n" + noisy.stdout[-6000:]
    got = _checksums(noisy_run)
    this_session = SESSIONS / f"session-{os.getpid()}" / "nbval"  # conftest's NBVAL_ROOT
    if (this_session / "hidden" / "index.parquet").is_file():
        want = _checksums(this_session)
    else:  # the goldens did not run in this session (this file alone)
        plain, plain_run = _run_goldens(None)
        assert plain.returncode == 0, plain.stdout[-6000:]
        want = _checksums(plain_run)
    assert got.keys() == want.keys()
    # the nudge reached the stored bytes: without this, a pass above would prove nothing
    assert all(got[f] != want[f] for f in got), (got, want)


def test_the_nudge_moves_every_weight_one_ulp():
    """The perturbation itself: a loaded model's float weights each move to the next float (up or down), no more."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("float_noise_site", NOISE / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lin = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in lin.parameters()]

    class Auto:
        @classmethod
        def from_pretrained(cls, *a, **k):
            return lin

    class Module:
        AutoModelForCausalLM = Auto

    mod._DIRECTION = "down"
    mod._nudge(Module)
    Module.AutoModelForCausalLM.from_pretrained("x")
    for b, p in zip(before, lin.parameters()):
        assert torch.equal(p, torch.nextafter(b, torch.full_like(b, float("-inf"))))
        assert (p < b).all()
