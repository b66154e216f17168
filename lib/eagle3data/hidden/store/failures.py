"""Samples 04 could not capture, and what they do to the stage: a sample the engine failed is a failed stage.

Whatever the backend (`hf`: a batch whose forward raised or gave NaN/Inf; `vllm`, `sglang`: a reply or file
that stayed wrong after the request's retries), a sample that is not stored is recorded by the worker that
tried it in `<hidden>/failed_samples.json` (`failed_samples.r<rank>.json` under `torchrun`): its key, the
error, the pass and the engine's own ledger. Then:

- more failures than `hidden.allow_failed_samples` (default 0): 04 merges nothing and raises `SamplesFailed`
  (exit 1; `eagle3data run`: the stage failed) in one line: how many, the first error, the file. A rerun of the
  same command sends only what is missing;
- up to that many: the merge (`merge.merge_store`, whichever worker merges) takes the missing samples that a
  worker recorded as failed out of the mix, each as a drop with reason `capture_failed` and its error
  (`mix_manifest.json`), names them in `index.json` (`failed_samples`), and 05 exports the rest, listing them
  among its skipped samples. A rerun of 04 rebuilds the mix from the records and retries them.

A server 04 launched that dies under it (killed, crashed) is `EngineDied` (exit 1): the capture stops at once,
keeps what came back, stops what is left of the server, and names the server's log.

A mix with no sample (every record dropped: failed the audit, errors, ...; or every sample failed and accepted) is
`MixEmpty` (exit 1, one line: the records, each drop reason with its count, the mix manifest): 04 stores nothing and
merges no index (`require_samples`, before the capture and at the merge); 05 refuses such a mix too (`empty_mix_line`).

`require_merged_states` is 05's side: a format whose hand-off needs the states is refused (exit 2, one line)
for a run whose 04 planned a mix and merged no index.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from eagle3data.core.atomic import write_atomic
from eagle3data.core.reader import Sample
from eagle3data.hidden.mix import MANIFEST_FILE, MIX_FILE, Mix, hidden_dir, mix_figures, write_mix
from eagle3data.hidden.store.format import INDEX_FILE, INFO_FILE, HiddenError
from eagle3data.trainers.registry import TRAINERS

FAILED_FILE = "failed_samples.json"
FAILED_GLOB = "failed_samples*.json"


class SamplesFailed(HiddenError):
    """Samples of this worker were not stored (after their retries), more than `hidden.allow_failed_samples`:
    the stage failed (exit status 1). `result` is the worker's ExtractResult."""

    status = 1

    def __init__(self, msg: str, result: Any = None):
        super().__init__(msg)
        self.result = result


class EngineDied(HiddenError):
    """The server 04 launched died during the capture (exit status 1); what came back is stored."""

    status = 1


class MixEmpty(HiddenError):
    """The training mix holds no sample: 04 has nothing to store, a failed stage (exit status 1)."""

    status = 1


class StatesNotMerged(HiddenError):
    """05 asked for a format that needs 04's states, and 04 merged none for this run (exit status 2)."""


def failures_path(hdir: Path, rank: int, world: int) -> Path:
    """This worker's record of the samples it failed."""
    return hdir / (FAILED_FILE if world == 1 else f"failed_samples.r{rank}.json")


def clear_failures(hdir: Path, rank: int, world: int) -> None:
    """Before a worker captures: its earlier record goes (alone, every worker's: it retries all of them)."""
    if world == 1:
        for f in hdir.glob(FAILED_GLOB):
            f.unlink(missing_ok=True)
    else:
        failures_path(hdir, rank, world).unlink(missing_ok=True)


def write_failures(hdir: Path, rank: int, world: int, failures: list[dict[str, Any]], *, backend: str,
                   ledgers: list[str], tried: int) -> Path | None:
    """Record this worker's failed samples (none: no file); the path written."""
    path = failures_path(hdir, rank, world)
    if not failures:
        path.unlink(missing_ok=True)
        return None
    hdir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, orjson.dumps({"rank": rank, "world_size": world, "backend": backend, "tried": tried,
                                     "failed": len(failures), "ledgers": ledgers, "failures": failures},
                                    option=orjson.OPT_INDENT_2))
    return path


def read_failures(hdir: Path) -> dict[str, dict[str, Any]]:
    """Every worker's recorded failures by sample key (an unreadable record counts as none)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(hdir.glob(FAILED_GLOB)):
        try:
            rec = orjson.loads(f.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
        for x in rec.get("failures") or []:
            if isinstance(x, dict) and x.get("key"):
                out.setdefault(str(x["key"]), {**x, "file": f.name})
    return out


def hf_failure(s: Sample, error: str) -> dict[str, Any]:
    """A sample the HF forward failed, as the engines record theirs."""
    return {"key": str(s.key), "dataset": s.dataset, "sample_id": s.sample_id, "turn": s.turn, "pass": "hf",
            "error": error}


def accepted_failures(hdir: Path) -> list[dict[str, Any]]:
    """The failed samples the merged index accepted (`index.json` `failed_samples`)."""
    try:
        return list(orjson.loads((hdir / INFO_FILE).read_bytes()).get("failed_samples") or [])
    except (OSError, ValueError):
        return []


def accepted_line(accepted: list[dict[str, Any]], allowed: int) -> str:
    return (f"04: {len(accepted)} failed sample{'s' if len(accepted) != 1 else ''} accepted (hidden.allow_failed_samples "
            f"{allowed}), left out of the mix as capture_failed: "
            + "; ".join(f"{x['key']}: {short(x.get('error'), 120)}" for x in accepted[:5]))


def drop_failed(mix: Mix, failed: list[dict[str, Any]], out_dir: Path) -> Mix:
    """The mix without the failed samples the merge accepts: each a drop `capture_failed` with its error, the
    manifest's counts and fingerprint redone (`mix.mix_figures`); written over the mix."""
    gone = {str(f["key"]): f for f in failed}
    dropped = list(mix.dropped) + [{"key": str(s.key), "dataset": s.dataset, "sample_id": s.sample_id, "turn": s.turn,
                                    "reason": "capture_failed", "error": gone[str(s.key)].get("error"),
                                    "pass": gone[str(s.key)].get("pass")} for s in mix.samples if str(s.key) in gone]
    samples = [s for s in mix.samples if str(s.key) not in gone]
    out = Mix(samples, {**mix.manifest, **mix_figures(samples, dropped)}, dropped=dropped, view=mix.view)
    out.path = write_mix(out, out_dir)
    return out


def short(text: Any, n: int = 240) -> str:
    """An error's first line, cut to `n` characters (the one-line messages quote it)."""
    line = (str(text).strip().splitlines() or [""])[0]
    return line if len(line) <= n else line[: n - 3] + "..."


def failed_line(failures: list[dict[str, Any]], tried: int, path: Path | None, ledgers: list[str],
                allowed: int) -> str:
    """The one line of a worker whose failed samples stop the stage."""
    first = failures[0]
    where = f"{path}" + (f" (engine ledger: {', '.join(ledgers)})" if ledgers else "")
    accept = (f"hidden.allow_failed_samples is {allowed}" if allowed else
              "or accept a few with hidden.allow_failed_samples N")
    return (f"{len(failures)} of {tried} samples failed after their retries, first {first['key']}: "
            f"{short(first.get('error'))}; ledger: {where}; no index merged, nothing to export: run the same "
            f"command again to retry them ({accept})")


def empty_mix_line(mix: Mix, where: Path | str) -> str:
    """Why a mix is empty, in one line: its records, each drop reason with its count (most first), where to look."""
    n = len(mix.dropped)
    reasons = ", ".join(f"{r} {c}" for r, c in sorted(Counter(d["reason"] for d in mix.dropped).items(),
                                                         key=lambda x: (-x[1], x[0])))
    return (f"the mix is empty: {n} record{'s' if n != 1 else ''}, all dropped ({reasons})" if n
            else "the mix is empty: no records of the chosen datasets") + f": see {where}"


def require_samples(mix: Mix, hdir: Path) -> None:
    """04's rule for a mix with no sample: MixEmpty (one line naming the mix manifest), nothing stored or merged."""
    if not mix.samples:
        raise MixEmpty("04: " + empty_mix_line(mix, hdir / MANIFEST_FILE) + "; no index merged, nothing to export")


def require_merged_states(params: Any, fmt: str) -> None:
    """05's guard, before anything of `fmt` is written: StatesNotMerged (one line) when `fmt` is a trainer's offline
    hand-off (it needs 04's states) and this run's 04 planned a mix but merged no index (stopped, failed samples, a
    dead engine). A run whose 04 never ran exports token files only, as before; online formats need no store."""
    if params is None or fmt not in TRAINERS:  # no params: no hand-off written; not a trainer's offline hand-off
        return
    hdir = hidden_dir(params)
    if not (hdir / MIX_FILE).exists() or (hdir / INDEX_FILE).exists():
        return
    failed = read_failures(hdir)
    if failed:
        first = next(iter(failed.values()))
        why = (f"{len(failed)} sample{'s' if len(failed) != 1 else ''} failed, first {first['key']}: "
               f"{short(first.get('error'), 160)}; {hdir / first['file']}")
    else:
        why = "it stopped or did not finish"
    raise StatesNotMerged(f"{hdir / INDEX_FILE} is missing: 04 did not merge the hidden states ({why}); the {fmt} "
                          "hand-off needs them: run 04 again (it resumes) before exporting")
