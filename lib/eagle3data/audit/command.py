"""`python -m eagle3data audit RECORDS`: any journal, folder of journals or columnar file audited as 03 audits a run.

The records stream through the stage's own path (`run.audit_chunks` on `streamed.file_chunks`: a chunk of lines
checked at a time, each record's small facts kept), so the command's memory is set by the chunk, not by the input.
What the input must be is checked as the chunks go by (`_Watch`), with the same verdicts a whole read gave: no
unreadable line (from the first one on, the rest of the input is only read, so that the one error line names the bad
lines a whole read named; nothing is written), some records, and, without `--profile`, one profile named by them.
The profile is needed before the first check: the first chunks are read ahead until a record names one (or the
input is refused), then the audit reads the input from its start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3data.audit.idtable import AuditInputError
from eagle3data.audit.run import audit_chunks
from eagle3data.audit.streamed import Chunk, file_chunks
from eagle3data.core.models import load_tokenizer, tokenizer_for
from eagle3data.core.params import AuditParams
from eagle3data.core.profiles import Profile, get_profile
from eagle3data.core.provenance import RunParamsError, params_of_run

CHUNK_RECORDS: int = AuditParams.model_fields["chunk_records"].default  # audit.chunk_records' default
SHOWN_BAD_LINES = 20  # unreadable lines named in the error


def _inputs(path: Path) -> tuple[list[Path], Path]:
    """The records files of RECORDS (a file, or a folder's `*.jsonl`) and the run folder it would sit in."""
    if path.is_dir():
        paths = sorted(path.glob("*.jsonl"))
        if not paths:
            raise AuditInputError(f"{path}: no *.jsonl journals in this folder")
        return paths, path.parent
    if not path.exists():
        raise AuditInputError(f"{path}: no such file")
    return [path], path.parent.parent


class _Watch:
    """What the command refuses, seen chunk by chunk: unreadable lines, no records, no one profile named (when
    `--profile` is not given). `passing` hands the chunks on; at a bad line it reads the rest of the input only for
    its bad lines, then refuses (`check`)."""

    def __init__(self, path: Path, profile: str | None) -> None:
        self.path, self.given = path, profile
        self.bad: list[str] = []
        self.lines = 0
        self.named: set[str] = set()

    def see(self, c: Chunk | int) -> None:
        if isinstance(c, int):
            return
        if len(self.bad) < SHOWN_BAD_LINES:
            self.bad += c.table.bad_lines[: SHOWN_BAD_LINES - len(self.bad)]
        self.lines += len(c.table)
        if self.given is None:
            self.named.update(str(p) for p in c.table.meta["profile"].dropna().unique())

    def passing(self, chunks: Iterator[tuple[int, Chunk | int]]) -> Iterator[tuple[int, Chunk | int]]:
        for k, c in chunks:
            self.see(c)
            if self.bad or len(self.named) > 1:  # refused: what a whole read says, the rest of the input read for it
                self.finish(chunks)
            yield k, c

    def finish(self, chunks: Iterator[tuple[int, Chunk | int]]) -> None:
        """Read the rest of the chunks (the lines are only counted) and refuse the input if it must be."""
        for _, c in chunks:
            self.see(c)
        self.check()

    def check(self) -> None:
        if self.bad:
            raise AuditInputError("unreadable lines:\n  " + "\n  ".join(self.bad))
        if not self.lines:
            raise AuditInputError(f"{self.path}: no records")
        if self.given is None and len(self.named) != 1:
            named = "no profile" if not self.named else "profiles " + ", ".join(sorted(self.named))
            raise AuditInputError(f"{self.path}: the records name {named}: pass --profile NAME")

    @property
    def profile(self) -> str | None:
        """The profile given, or the one the records seen so far name (None while they name none)."""
        return self.given if self.given is not None else next(iter(self.named), None)


def _profile(path: Path, paths: list[Path], profile: str | None, chunk_records: int) -> str:
    """The profile to audit with, from the first chunks (read until a record names it, or the input is refused)."""
    ahead = _Watch(path, profile)
    for _ in ahead.passing(file_chunks(paths, chunk_records)):
        if ahead.lines and ahead.profile is not None:
            break
    else:
        ahead.check()  # the whole input read, and refused: no records, or none names a profile
    return str(ahead.profile)


def _cli_tokenizer(tokenizer: str | None, run_dir: Path, profile: Profile) -> tuple[Any, str]:
    """The tokenizer for the CLI's text checks: `--tokenizer`, else the run's own (its recorded params); and why not."""
    if tokenizer:
        return load_tokenizer(tokenizer, trust_remote_code=True, profile=profile), f"tokenizer {tokenizer}"
    try:
        params = params_of_run(run_dir)
    except RunParamsError as e:
        return None, f"no recorded params of the run ({e}); pass --tokenizer PATH"
    try:
        return tokenizer_for(params), f"the run's tokenizer ({params.model.tokenizer_path or params.model.path})"
    except (OSError, ValueError) as e:
        return None, f"the run's tokenizer cannot be loaded here ({type(e).__name__}: {str(e).splitlines()[0]}); " \
                     "pass --tokenizer PATH"


def audit_cli(records: str, *, profile: str | None, out: str, tokenizer: str | None = None,
              allow_failed: bool = False, chunk_records: int = CHUNK_RECORDS) -> int:
    """`python -m eagle3data audit RECORDS [--profile NAME] --out DIR [--tokenizer PATH] [--allow-failed]`.

    RECORDS: a journal, a folder of `*.jsonl` journals (in a run's `records/` or not) or a .parquet, read
    `chunk_records` lines at a time; 02's rebuilt ids are merged in when the journals sit in a run with `reconstruct/`.
    The profile comes from the records when not given; the tokenizer checks run with `--tokenizer`
    or the run's own tokenizer (from its recorded params), and the output says which or why not.
    Exit status: 0 when no record failed, 1 when some did (a CI gate; `--allow-failed` exits 0; a flag is no failure),
    2 when the input cannot be read (raised: `cli.main` says it in one line).
    """
    path = Path(records)
    paths, run_dir = _inputs(path)
    prof = get_profile(_profile(path, paths, profile, chunk_records))
    tok, why = _cli_tokenizer(tokenizer, run_dir, prof)
    watch = _Watch(path, profile)
    result = audit_chunks(watch.passing(file_chunks(paths, chunk_records)), run_dir, prof, tokenizer=tok)
    watch.check()  # a later record naming another profile: refused, as a whole read would, before anything is written
    vp, sp = result.write(out)
    s = result.summary()
    print(f"audited {s['records']} records ({s['output_tokens']} output tokens, profile {prof.name}) in "
          f"{result.seconds:.2f} s: {s['records_failed']} failed, {s['records_truncated']} truncated")
    print(f"tokenizer checks: {'run with ' + why if tok is not None else 'NOT RUN: ' + why}")
    if s["superseded_lines"]:
        print(f"superseded: {s['superseded_lines']} earlier journal line(s) replaced by a later line of the same "
              "sample (a retried error): not audited")
    if s["torn_tail_bytes"]:
        print(f"torn tail: {s['torn_tail_bytes']} bytes after the last complete line (a write cut off): ignored")
    for name, c in s["checks"].items():
        if c["failed"]:
            print(f"  {name}: {c['failed']}/{c['applicable']} failed")
        if c["flagged"]:
            print(f"  {name}: {c['flagged']}/{c['applicable']} flagged (audit.flag_only: kept, not failed)")
    print(f"wrote {vp} and {sp}")
    return 1 if s["records_failed"] and not allow_failed else 0
