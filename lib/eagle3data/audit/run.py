"""Stage 03: audit every record of a run, with honest numbers.

The run's journals are read `audit.chunk_records` lines at a time into flat id arrays
(`idtable.py`, `streamed.py`: memory set by the chunk, not by the run); every check of
`checks.py` and `textchecks.py` runs on each chunk, whose ids and texts are then let go; one row
per sample is kept by the one supersede rule (`reader.supersede_rule`: a retried error is
*superseded*, shown as such, never counted as a failure or a duplicate); a record's verdict lists
the names of the checks it failed and of those it was flagged by (`audit.flag_only`: counted and
shown, the record kept in the mix). `finish_reason: length` is reported as truncated, never as
broken. Bounds on failure rates come from `stats.py`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import orjson
import pandas as pd

from eagle3data.audit.checks import (CHECK_NAMES, CHECKS, FAIL, FLAG, NA, NOT_RUN, PASS, Positions, cross_record_checks,
                                     generation_suffix, billed_prompt_checks, iter_checks, on_policy_checks,
                                     structural_checks, suffix_check)
from eagle3data.audit.idtable import IdTable
from eagle3data.audit.runtable import empty_table, merge_reconstruct, take_records
from eagle3data.audit.rebuilt import RebuiltIds
from eagle3data.audit.streamed import Chunk, LineAudit, RecordFacts, file_chunks
from eagle3data.core.atomic import write_atomic
from eagle3data.core.profiles import Profile, get_profile
from eagle3data.core.stats import upper95
from eagle3data.core.models import tokenizer_for
from eagle3data.core.params import AuditParams
from eagle3data.core.reader import COMPLETED
from eagle3data.core.provenance import write_provenance
from eagle3data.generate.ledger import read_ledger
from eagle3data.prompts.load import load_datasets, template_prompt

TARGET_RATE = 0.001  # the failure rate the "records needed" column bounds (0.1 %)
FLAG_ONLY: tuple[str, ...] = tuple(AuditParams.model_fields["flag_only"].default)  # audit.flag_only's default


@dataclass
class AuditResult:
    """Statuses of every record for every check, with the tables and numbers built on them."""

    table: IdTable | RecordFacts  # in memory (audit_table), or the records without their ids (run_audit)
    profile: Profile
    status: pd.DataFrame  # one row per record, one int8 column per check
    positions: Positions
    tokenizer_used: bool
    seconds: float
    ledger: dict[str, Any] | None = None
    skipped_lengths: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)
    superseded: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        columns=["dataset", "sample_id", "finish_reason", "file", "line", "record_line"]))
    prompt_calibration: list[dict[str, Any]] = field(default_factory=list)  # billed prompt counts per group
    flag_only: tuple[str, ...] = FLAG_ONLY  # checks that flag a record instead of failing it (audit.flag_only)

    @property
    def meta(self) -> pd.DataFrame:
        return self.table.meta

    def failed_lists(self, status: int = FAIL) -> list[list[str]]:
        """Per record, the names of the checks it failed (`status=FLAG`: those it was flagged by)."""
        fails = self.status.to_numpy() == status
        cols = np.array(self.status.columns)
        return [cols[row].tolist() for row in fails]

    def verdicts(self) -> pd.DataFrame:
        """One row per record: dataset, sample_id, failed and flagging check names, truncated."""
        m = self.meta
        return pd.DataFrame({"dataset": m["dataset"], "sample_id": m["sample_id"], "failed": self.failed_lists(),
                             "flagged": self.failed_lists(FLAG), "truncated": (m["finish_reason"] == "length").to_numpy()})

    def group_keys(self) -> pd.DataFrame:
        m = self.meta
        return pd.DataFrame({"dataset": m["dataset"].astype(str), "source": m["source"].fillna("?").astype(str),
                             "provider": m["provider"].fillna("-").astype(str)})

    def check_table(self, by_group: bool = True) -> pd.DataFrame:
        """Honest numbers: per (dataset, source, provider) and check, counts and the 95 % bound.

        `upper95` is the rule-of-three bound 3/n when a check saw zero failures in n applicable
        records (else the Wilson 95 % upper bound); `records_for_0.1%` is how many applicable
        records a clean check needs before its bound drops to 0.1 %. A flagging check's
        (`audit.flag_only`) records that did not hold are `flagged`, not `failed`; its rate and bound are theirs.
        """
        keys = self.group_keys() if by_group else pd.DataFrame({"dataset": ["(all)"] * len(self.meta)})
        gcols = list(keys.columns)
        # per group (numbered in order of first appearance) and check, each status counted by bincount: one row per
        # (check, group), check-major, as the groupby of the checks' long table gave them, without that table
        codes = keys.groupby(gcols, sort=False).ngroup().to_numpy(np.int64)
        n_groups = int(codes.max()) + 1 if len(codes) else 0
        first = np.unique(codes, return_index=True)[1]
        st, checks = self.status.to_numpy(), list(self.status.columns)
        agg = pd.concat([keys.iloc[first].reset_index(drop=True)] * len(checks), ignore_index=True) if checks \
            else keys.iloc[:0].reset_index(drop=True)
        agg["check"] = np.repeat(np.asarray(checks, dtype=object), n_groups)
        agg["records"] = np.tile(np.bincount(codes, minlength=n_groups), len(checks)).astype(np.int64)
        for name, value in (("failed", FAIL), ("passed", PASS), ("not_applicable", NA), ("not_run", NOT_RUN),
                            ("flagged", FLAG)):
            agg[name] = np.concatenate([np.bincount(codes[st[:, j] == value], minlength=n_groups)
                                        for j in range(len(checks))] or [np.zeros(0)]).astype(np.int64)
        agg["applicable"] = agg["passed"] + agg["failed"] + agg["flagged"]
        bad = agg["failed"] + agg["flagged"]
        agg["fail_rate"] = np.where(agg["applicable"] > 0, bad / agg["applicable"].clip(lower=1), np.nan)
        agg["upper95"] = [upper95(f, a) for f, a in zip(bad, agg["applicable"])]
        need = math.ceil(3 / TARGET_RATE)
        clean = (bad == 0) & (agg["applicable"] > 0)
        agg["records_for_0.1%"] = np.where(clean, need, np.nan)
        agg["more_needed"] = np.where(clean, np.maximum(0, need - agg["applicable"]), np.nan)
        agg["verdict"] = [_verdict(r) for r in agg.itertuples()]
        return agg

    def check_summary(self) -> pd.DataFrame:
        """One row per check over all records: the table to read first."""
        t = self.check_table(by_group=False).drop(columns=["dataset"]).set_index("check")
        t.insert(0, "what", [CHECKS[c].what for c in t.index])
        return t

    def check_matrix(self) -> pd.DataFrame:
        """Wide view: one row per (dataset, source, provider), one column per applicable check."""
        ct = self.check_table()
        ct = ct[ct["check"].isin([c.name for c in iter_checks(self.profile)])]
        short = np.where(ct["failed"] > 0, "FAIL " + ct["failed"].astype(str) + "/" + ct["applicable"].astype(str),
                         np.where(ct["flagged"] > 0, "flagged " + ct["flagged"].astype(str) + "/"
                                  + ct["applicable"].astype(str), np.where(ct["applicable"] > 0, "0/" + ct["applicable"].astype(str) + " (<"
                                  + (ct["upper95"] * 100).round(1).astype(str) + "%)",
                                  np.where(ct["not_run"] > 0, "not run", "n/a"))))
        ct = ct.assign(cell=short)
        wide = ct.pivot_table(index=["dataset", "source", "provider"], columns="check", values="cell",
                              aggfunc="first", sort=False)
        return wide[[c for c in CHECK_NAMES if c in wide.columns]]

    def group_table(self) -> pd.DataFrame:
        """Per (dataset, source, provider): records, truncated, records with any failure, records flagged."""
        keys = self.group_keys()
        fails = (self.status.to_numpy() == FAIL).any(axis=1)
        df = keys.assign(records=1, truncated=(self.meta["finish_reason"] == "length").to_numpy(),
                         errors=self.meta["finish_reason"].isin(["error", "abort"]).to_numpy(), failed=fails,
                         flagged=(self.status.to_numpy() == FLAG).any(axis=1),
                         output_tokens=self.table.output_len, prompt_tokens=self.table.prompt_len)
        return df.groupby(list(keys.columns)).sum().reset_index()

    def failing(self, check: str, k: int = 3) -> pd.DataFrame:
        """The first k records that failed (or were flagged by) `check` (dataset, sample_id, line)."""
        idx = np.flatnonzero(np.isin(self.status[check].to_numpy(), (FAIL, FLAG)))[:k]
        return self.meta.iloc[idx][["dataset", "sample_id", "file", "line"]]

    def lengths(self) -> pd.DataFrame:
        """Per record: prompt, reasoning, answer and output lengths in tokens, plus positions."""
        p = self.positions
        L = self.table.output_len
        has_close = p.n_close > 0
        reasoning = np.where(has_close, p.first_close - p.reasoning_start, np.nan) if self.profile.is_reasoning \
            else np.full(len(L), np.nan)
        aend = np.where(p.n_eot > 0, p.first_eot, L)
        answer = np.where(has_close, aend - p.first_close - 1, aend) if self.profile.is_reasoning else aend
        df = pd.DataFrame({"dataset": self.meta["dataset"].astype(str), "sample_id": self.meta["sample_id"],
                           "finish_reason": self.meta["finish_reason"], "prompt": self.table.prompt_len,
                           "output": L, "reasoning": reasoning, "answer": answer,
                           "close_pos": np.where(has_close, p.first_close, np.nan),
                           "eot_pos": np.where(p.n_eot > 0, p.first_eot, np.nan)})
        return df[self.table.has_output]

    def record_index(self, dataset: str | None, sample_id: Any) -> int | None:
        """Row of (dataset, sample_id) in the table (any dataset when None), or None."""
        m = self.meta
        hit = m["sample_id"].astype(str) == str(sample_id)
        if dataset is not None:
            hit &= m["dataset"].astype(str) == str(dataset)
        idx = np.flatnonzero(hit.to_numpy())
        return int(idx[0]) if len(idx) else None

    def summary(self) -> dict[str, Any]:
        """What `summary.json` holds: counts per check and group, bounds, what was not run."""
        cs = self.check_summary()
        checks = {}
        for name, r in cs.iterrows():
            checks[name] = {"what": r["what"], "applicable": int(r["applicable"]), "failed": int(r["failed"]),
                            "flagged": int(r["flagged"]), "gates": name not in self.flag_only,
                            "not_applicable": int(r["not_applicable"]), "not_run": int(r["not_run"]),
                            "upper95": None if pd.isna(r["upper95"]) else float(r["upper95"]),
                            "verdict": r["verdict"]}
        groups = self.group_table()
        ct = self.check_table()
        fails = ct[ct["failed"] > 0][["dataset", "source", "provider", "check", "failed", "applicable"]]
        flags = ct[ct["flagged"] > 0][["dataset", "source", "provider", "check", "flagged", "applicable"]]
        return {
            "profile": self.profile.name,
            "records": len(self.meta),
            "output_tokens": int(self.table.output_len.sum()),
            "prompt_tokens": int(self.table.prompt_len.sum()),
            "records_failed": int((self.status.to_numpy() == FAIL).any(axis=1).sum()),
            "records_flagged": int((self.status.to_numpy() == FLAG).any(axis=1).sum()),
            "flag_only": list(self.flag_only),
            "records_truncated": int((self.meta["finish_reason"] == "length").sum()),
            "tokenizer_checks": "run" if self.tokenizer_used else "not run (no tokenizer)",
            "checks": checks,
            "groups": _jsonable(groups.to_dict(orient="records")),
            "failures": _jsonable(fails.to_dict(orient="records")),
            "flags": _jsonable(flags.to_dict(orient="records")),
            "ids_from": _jsonable(self.meta.get("ids_from", pd.Series(dtype=str)).value_counts().to_dict()),
            "proof_levels": _jsonable(self.meta.get("proof_level", pd.Series(dtype=str)).value_counts().to_dict()),
            "prompt_calibration": _jsonable(self.prompt_calibration),
            "bad_lines": self.table.bad_lines,
            "torn_tail_bytes": self.table.torn_tail_bytes,
            "superseded_lines": len(self.superseded),
            "superseded": _jsonable(self.superseded.to_dict(orient="records")),
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
        }

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write `verdicts.jsonl` and `summary.json` into out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        m = self.meta
        trunc = (m["finish_reason"] == "length").to_numpy()
        lines = [orjson.dumps({"dataset": d, "sample_id": _py(s), "failed": f, "flagged": g, "truncated": bool(t)})
                 for d, s, f, g, t in zip(m["dataset"], m["sample_id"], self.failed_lists(), self.failed_lists(FLAG),
                                          trunc)]
        if "turn" in m and m["turn"].notna().any():  # generate.turns: all: a verdict per turn (its SampleKey)
            lines = [ln if t is None or t != t else ln[:-1] + b',"turn":%d}' % int(t) for ln, t in zip(lines, m["turn"])]
        vp, sp = out / "verdicts.jsonl", out / "summary.json"
        write_atomic(vp, b"\n".join(lines) + (b"\n" if lines else b""))
        sp.write_bytes(orjson.dumps(self.summary(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        return vp, sp


def _py(x: Any) -> Any:
    return x.item() if isinstance(x, np.generic) else x


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def _verdict(r: Any) -> str:
    if r.not_run and not r.applicable:
        return "not run"
    if not r.applicable:
        return "n/a"
    if r.failed:
        return f"FAIL {r.failed}/{r.applicable}"
    if r.flagged:
        return f"flagged {r.flagged}/{r.applicable}"
    return f"0/{r.applicable} (< {r.upper95:.2%})"


def _id_checks(table: IdTable, profile: Profile, suffix: list[int] | None) -> tuple[dict[str, np.ndarray], Positions]:
    """The checks of a chunk's records by their ids alone: complete, has ids, the structural id checks, the
    generation prompt (`suffix`; None: not run)."""
    done = table.meta["finish_reason"].isin(COMPLETED).to_numpy(dtype=bool)
    st: dict[str, np.ndarray] = {
        "record.complete": np.where(done, PASS, FAIL).astype(np.int8),
        "record.has_ids": np.where(table.has_output & table.has_prompt, PASS, FAIL).astype(np.int8),
    }
    st["record.has_ids"][~done] = NA
    s2, pos = structural_checks(table, profile)
    st.update(s2)
    if suffix is not None:
        st["prompt.generation_prompt"] = suffix_check(table, suffix)
    return st, pos


def _line_audit(profile: Profile, tokenizer: Any, roundtrip: bool, *, hash_ids: bool = True) -> LineAudit:
    """The per-record checks of this profile (and tokenizer): the generation prompt from the template (without a
    tokenizer only Kimi's trailing reasoning-open; else the check is not run)."""
    suffix = None
    if tokenizer is not None:
        suffix = generation_suffix(tokenizer, profile)
    elif profile.prompt_ends_with_reasoning_open and profile.reasoning_open is not None:
        suffix = [profile.reasoning_open.id]
    return LineAudit(profile, lambda t: _id_checks(t, profile, suffix), tokenizer, roundtrip, hash_ids=hash_ids)


def _audit_result(lines: LineAudit, profile: Profile, t0: float, *, calibration: dict[str, Any] | None,
                  flag_only: tuple[str, ...] | list[str], table: IdTable | None = None, rebuilt: Any = None,
                  run_dir: Path | None = None) -> AuditResult:
    """The checks across records on the records' facts, the status grid and the notes (`table`: the lines held in
    memory, kept as the result's table; else its table is the facts, each record read back when inspected)."""
    rec, facts, st, pos, hashes, turns, superseded = lines.finish(rebuilt, run_dir)
    n = len(facts)
    records = None
    if table is not None:  # in memory: the records' table with its ids (its outputs compared from them)
        records = take_records(table, rec) if len(rec) != len(table) else table
        records.meta = facts.meta
    st.update(cross_record_checks(facts if records is None else records, hashes))
    st.update(on_policy_checks(facts, turns))
    billed, prompt_calibration = billed_prompt_checks(facts, calibration)
    st.update(billed)
    grid = np.empty((n, len(CHECK_NAMES)), np.int8)  # one block: a frame of 23 separate columns costs more than the checks
    not_run = []
    for j, c in enumerate(CHECK_NAMES):
        if not CHECKS[c].applies(profile):
            grid[:, j] = NA
        elif c in st:
            grid[:, j] = st[c]
        else:
            grid[:, j] = NOT_RUN
            not_run.append(c)
        if c in flag_only:
            grid[grid[:, j] == FAIL, j] = FLAG
    status = pd.DataFrame(grid, columns=CHECK_NAMES)
    notes = []
    if lines.tokenizer is None:
        notes.append("no tokenizer: " + ", ".join(c for c in CHECK_NAMES if n and (c in not_run or (
            c in st and (st[c] == NOT_RUN).all()))) + " not run")
    if len(superseded):
        notes.append(f"{len(superseded)} journal line(s) superseded by a later line of the same sample "
                     "(a retried error): shown in `superseded`, not audited, not counted")
    for row in prompt_calibration:
        if row["prompt_offset"] or row["off_offset"]:
            cal = "calibrated" if row["calibrated"] else "not calibrated"
            notes.append(f"billed prompt tokens, provider {row['provider']}, {row['dataset']}: offset "
                         f"{row['prompt_offset']:+d} from the local template ({cal}, mode {row['mode']:+d} in "
                         f"{row['mode_share']:.0%}), {row['off_offset']}/{row['records']} record(s) off it")
    return AuditResult(facts if records is None else records, profile, status, pos, lines.tokenizer is not None,
                       time.perf_counter() - t0, notes=notes, superseded=superseded,
                       prompt_calibration=prompt_calibration, flag_only=tuple(flag_only))


def _check_flag_only(flag_only: tuple[str, ...] | list[str]) -> None:
    unknown = [c for c in flag_only if c not in CHECKS]
    if unknown:
        raise ValueError(f"audit.flag_only: no check named {unknown[0]!r} (the checks: {', '.join(CHECK_NAMES)})")


def audit_table(table: IdTable, profile: Profile, *, tokenizer: Any = None, roundtrip: bool = True,
                progress: bool = False, calibration: dict[str, Any] | None = None,
                flag_only: tuple[str, ...] | list[str] = FLAG_ONLY) -> AuditResult:
    """Run every check that applies to this profile on the records of an IdTable held in memory (one chunk of
    `streamed.LineAudit`: the checks and verdicts `run_audit` gives the same lines read in chunks).

    A record that does not hold a check named in `flag_only` is flagged by it, not failed (`audit.flag_only`).

    The table may hold every journal line: the supersede rule keeps one row per key (the
    record) and the replaced lines go to `AuditResult.superseded`, outside every count.
    """
    _check_flag_only(flag_only)
    t0 = time.perf_counter()
    lines = _line_audit(profile, tokenizer, roundtrip, hash_ids=False)
    lines.add(table)
    return _audit_result(lines, profile, t0, calibration=calibration, flag_only=flag_only, table=table)


def audit_chunks(chunks: Iterable[tuple[int, Chunk | int]], run_dir: Path, profile: Profile, *, tokenizer: Any = None,
                 roundtrip: bool = True, calibration: dict[str, Any] | None = None,
                 flag_only: tuple[str, ...] | list[str] = FLAG_ONLY) -> AuditResult:
    """Records files audited a chunk at a time (`streamed.file_chunks`: `(k, Chunk)`, k = 0 where a file begins, and
    each file's torn tail), 02's rebuilt ids merged in from `run_dir/reconstruct/` as each chunk needs them: memory
    set by the chunk, not by the files. The run's stage (`audit_run_chunked`) and the CLI (`command.audit_cli`)."""
    _check_flag_only(flag_only)
    t0 = time.perf_counter()
    rebuilt = RebuiltIds(run_dir)
    lines = _line_audit(profile, tokenizer, roundtrip)
    for k, c in chunks:
        if isinstance(c, int):
            lines.torn_tail_bytes += c
        else:
            lines.add(merge_reconstruct(c.table, run_dir, rebuilt), c.starts, new_file=k == 0)
    if not lines.lines:
        lines.add(merge_reconstruct(empty_table(), run_dir))
    return _audit_result(lines, profile, t0, calibration=calibration, flag_only=flag_only, rebuilt=rebuilt,
                         run_dir=run_dir)


def audit_run_chunked(run_dir: Path, profile: Profile, *, tokenizer: Any = None, roundtrip: bool = True,
                      chunk_records: int = 512, calibration: dict[str, Any] | None = None,
                      flag_only: tuple[str, ...] | list[str] = FLAG_ONLY, progress: bool = False) -> AuditResult:
    """Every journal line of a run (`records/*.jsonl`) audited `chunk_records` lines at a time (`audit_chunks`)."""
    from tqdm.auto import tqdm

    paths = sorted((run_dir / "records").glob("*.jsonl"))
    api = False

    def chunks() -> Iterator[tuple[int, Chunk | int]]:
        nonlocal api
        with tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc="audit",
                  disable=not progress) as bar:
            for k, c in file_chunks(paths, chunk_records):
                yield k, c
                if not isinstance(c, int):
                    api |= bool((c.table.meta["source"] == "api").any())
                    bar.update(c.size)

    result = audit_chunks(chunks(), run_dir, profile, tokenizer=tokenizer, roundtrip=roundtrip,
                          calibration=calibration, flag_only=flag_only)
    if api and not (run_dir / "reconstruct").is_dir():
        result.notes.append("no reconstruct/ folder: API records have no ids until 02_reconstruct runs")
    return result


# --------------------------------------------------------------------------- damage assessment and the stage


def prompt_length_groups(params: Any, result: AuditResult, tokenizer: Any) -> pd.DataFrame:
    """Prompt lengths of done vs. skipped vs. cancelled samples, so a biased budget cut shows."""
    m = result.meta
    df = pd.DataFrame({"dataset": m["dataset"].astype(str), "group": "done", "prompt_tokens": result.table.prompt_len})
    df = df[result.table.has_prompt & m["finish_reason"].isin(["stop", "length"]).to_numpy()]
    ledger = result.ledger or {}
    wanted: dict[str, dict[str, str]] = {}
    for name, d in ledger.get("datasets", {}).items():
        for grp in ("skipped", "cancelled"):
            for sid in d.get(f"{grp}_ids") or []:
                wanted.setdefault(name, {})[str(sid)] = grp
    if not wanted or tokenizer is None:
        return df.reset_index(drop=True)
    profile = get_profile(params.profile)
    rows = []
    for name, ps in load_datasets(params).items():
        w = wanted.get(name)
        if not w:
            continue
        for p in ps.prompts:
            grp = w.get(str(p.sample_id))
            if grp:
                rows.append({"dataset": name, "group": grp, "prompt_tokens": len(template_prompt(tokenizer, p, profile))})
    return pd.concat([df, pd.DataFrame(rows)], ignore_index=True)


def run_audit(params: Any, progress: bool = True, *, tokenizer: Any = None) -> AuditResult:
    """Stage 03: audit every record of the run; write `audit/verdicts.jsonl` and `audit/summary.json`."""
    run_dir = params.run_dir
    if not (run_dir / "records").is_dir():
        raise FileNotFoundError(f"no records at {run_dir / 'records'}: run 01_generate first")
    write_provenance(run_dir, "03_audit", params)
    profile = get_profile(params.profile)
    tokenizer = tokenizer or tokenizer_for(params)
    result = audit_run_chunked(run_dir, profile, tokenizer=tokenizer, roundtrip=params.audit.roundtrip,
                               chunk_records=params.audit.chunk_records, progress=progress,
                               calibration=params.reconstruct.count_calibration, flag_only=params.audit.flag_only)
    result.ledger = read_ledger(run_dir)
    result.skipped_lengths = prompt_length_groups(params, result, tokenizer)
    result.write(run_dir / "audit")
    return result
