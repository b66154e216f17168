"""The run's params: `RunParams` (one section per stage), loaded from YAML plus `-p key value` overrides
through the same validation; errors name the file and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from eagle3data.core.params.audit import AuditParams
from eagle3data.core.params.base import ModelParams, ParamsError, Strict
from eagle3data.core.params.export import ExportParams
from eagle3data.core.params.generate import DatasetParams, GenerateParams
from eagle3data.core.params.hidden import HiddenParams
from eagle3data.core.params.reconstruct import ReconstructParams
from eagle3data.core.params.value import ValueParams
from eagle3data.core.profiles import PROFILES


class RunParams(Strict):
    run_name: str = Field(description="Everything this run writes goes under `<output_root>/<run_name>/`.")
    output_root: str = Field("outputs", description="Root folder for runs (relative to the repository root).")
    profile: str = Field(description="Model profile: smollm2, qwen3, kimi-k2.5.")
    model: ModelParams
    datasets: list[DatasetParams] = Field(min_length=1, description="Prompt datasets to run.")
    generate: GenerateParams = Field(default_factory=GenerateParams)
    reconstruct: ReconstructParams = Field(default_factory=ReconstructParams)
    audit: AuditParams = Field(default_factory=AuditParams)
    hidden: HiddenParams = Field(default_factory=HiddenParams)
    export: ExportParams = Field(default_factory=ExportParams)
    value: ValueParams = Field(default_factory=ValueParams)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        if v not in PROFILES:
            raise ValueError(f"unknown profile {v!r}; known: {', '.join(sorted(PROFILES))}")
        return v

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, v: str) -> str:
        if not v or "/" in v or v.startswith("."):
            raise ValueError(f"run_name {v!r} must be a plain folder name")
        return v

    @model_validator(mode="after")
    def _unique_datasets(self) -> "RunParams":
        names = [d.name for d in self.datasets]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"dataset names must be unique, repeated: {sorted(dup)}")
        return self

    @property
    def run_dir(self) -> Path:
        root = Path(self.output_root)
        if not root.is_absolute():
            root = repo_root() / root
        return root / self.run_name


def repo_root() -> Path:
    """The repository root (folder holding pyproject.toml), or the working directory."""
    here = Path(__file__).resolve()
    for p in here.parents:
        if (p / "pyproject.toml").exists() and (p / "params").is_dir():
            return p
    return Path.cwd()


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.0.c` (or `datasets.<name>.limit`: a list item by its `name`) in the raw params.

    Raises ParamsError naming the key when an index is past the list, no item has that name,
    or the path goes through a value that is not a section (`run_name.x`).
    """
    keys = dotted.split(".")
    if not all(keys):
        raise ParamsError(f"override `{dotted}`: empty part in the dotted key")
    cur: Any = d
    for depth, k in enumerate(keys):
        here = ".".join(keys[:depth]) or "(top level)"
        last = depth == len(keys) - 1
        if isinstance(cur, list):
            if k.lstrip("-").isdigit():
                i = int(k)
                if not 0 <= i < len(cur):
                    raise ParamsError(f"override `{dotted}`: `{here}` has {len(cur)} item{'s' if len(cur) != 1 else ''} "
                                      f"(indices 0-{len(cur) - 1}), "
                                      f"no index {k}")
            else:
                names = [x.get("name") for x in cur if isinstance(x, dict)]
                if k not in names:
                    shown = ", ".join(str(n) for n in names if n is not None) or "none has a name"
                    raise ParamsError(f"override `{dotted}`: no item of `{here}` is named {k!r} (names: {shown})")
                i = names.index(k)
            if last:
                cur[i] = value
            else:
                cur = cur[i]
            continue
        if not isinstance(cur, dict):
            raise ParamsError(f"override `{dotted}`: `{here}` is a {type(cur).__name__} value ({cur!r}), "
                              f"not a section with a `{k}` key")
        if last:
            cur[k] = value
            return
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = {}
        cur = nxt


def parse_override(value: Any) -> Any:
    """Parse a `-p KEY VALUE` string the way YAML would (`3` -> 3, `true` -> True, `[a]` -> list)."""
    if not isinstance(value, str):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid params in {source}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key `{loc}` (not a parameter; check the spelling)")
        else:
            lines.append(f"  - `{loc}`: {e['msg']}")
    return "\n".join(lines)


def load_params(path: str | Path, overrides: dict[str, Any] | None = None) -> RunParams:
    """Load a params YAML, apply dotted-key overrides, validate; errors name file and key."""
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        alt = repo_root() / path
        if alt.exists():
            path = alt
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ParamsError(f"params file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"params file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"params file {path} must hold a mapping at the top level")
    source = str(path)
    if overrides:
        for k, v in overrides.items():
            try:
                _set_path(raw, k, parse_override(v))
            except ParamsError as e:
                raise ParamsError(f"invalid params in {path}: {e}") from None
        source += " with overrides " + ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    try:
        return RunParams.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_error(e, source)) from None


def with_overrides(params: RunParams, overrides: dict[str, Any], source: str, *, only: str | None = None) -> RunParams:
    """`params` with dotted-key overrides (`-p KEY VALUE`), validated as a params file's; `only`: the one section
    they may touch (e.g. `value` for a run's 06: the data it was made with stays as made)."""
    raw = params.model_dump(mode="json", exclude_none=True)
    for k, v in overrides.items():
        if only is not None and k.split(".", 1)[0] != only:
            raise ParamsError(f"param {k} (-p): only {only}.* can be changed here (the rest is what {source} was made with)")
        _set_path(raw, k, parse_override(v))
    try:
        return RunParams.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_error(e, source + " with overrides " + ", ".join(
            f"{k}={v!r}" for k, v in overrides.items()))) from None


def params_for_display(params: RunParams) -> dict[str, Any]:
    """The params as plain data for notebooks and the report (they hold no secrets by design)."""
    return params.model_dump(mode="json", exclude_none=True)
