"""Provenance: what code and packages produced a stage's outputs.

Each stage writes `outputs/<run>/provenance/<stage>.json` with the git commit (and whether
the tree was dirty), the package versions that matter, the params (no secrets by design:
params only name environment variables), and the time.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from eagle3data.core.errors import UserInputError
from eagle3data.core.params import RunParams, repo_root

PACKAGES = ("eagle3data", "torch", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow",
            "pandas", "httpx", "pydantic", "papermill")


def git_state(cwd: Path | None = None) -> dict[str, Any]:
    """Commit hash and dirty flag of the repository holding this package (None outside git)."""
    root = cwd or repo_root()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(stage: str, params: Any = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "stage": stage,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_state(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
    }
    if params is not None:
        data["params"] = params.model_dump(mode="json", exclude_none=True)
    return data


def write_provenance(run_dir: str | Path, stage: str, params: Any = None) -> Path:
    d = Path(run_dir) / "provenance"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{stage}.json"
    p.write_bytes(orjson.dumps(provenance(stage, params), option=orjson.OPT_INDENT_2))
    return p


class RunParamsError(UserInputError, ValueError):
    """A run folder's recorded params are missing or do not validate; the message names the file."""


def params_of_run(run_dir: str | Path) -> Any:
    """The params a run folder was made with: the latest stage's recorded params (04, 03, else 01), pointed at it."""
    import json


    run_dir = Path(run_dir)
    for stage in ("04_extract_hidden", "03_audit", "01_generate"):
        prov = run_dir / "provenance" / f"{stage}.json"
        if not prov.exists():
            continue
        data = json.loads(prov.read_text(encoding="utf-8")).get("params") or {}
        if data:
            data = {**data, "output_root": str(run_dir.parent.resolve()), "run_name": run_dir.name}
            try:
                return RunParams.model_validate(data)
            except ValueError as e:
                raise RunParamsError(f"{prov}: recorded params do not validate: {str(e).splitlines()[0]}") from None
    raise RunParamsError(f"{run_dir / 'provenance'}: no recorded params (01_generate.json): cannot tell the run's settings")

