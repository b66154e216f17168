"""README's `make run` section from the run it describes: what you see and what the run found.

The block of stage lines (each stage's wall time as `eagle3data run` printed it, `<run>/stage_times.json`) and the
paragraph after it (prompts, records, truncated, the audit's failures and flags, what 04's mix kept, what the
text-only trainers' path gives) are rendered from the files the stages wrote, the ones the report's summary reads
(`eagle3data.audit.overview`). They sit in README.md between `<!-- make-run:begin -->` and `<!-- make-run:end -->`.

    python tools/readme_run.py [RUN_DIR]           # says whether README.md agrees with the run (exit 1 if not)
    python tools/readme_run.py [RUN_DIR] --write   # rewrites the section from the run

`make run` ends with the check, so a README left behind by a change in what the embedded run does is said
at once; `--write` is the one deliberate refresh.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN, END = "<!-- make-run:begin -->", "<!-- make-run:end -->"
STAGE_ORDER = ("01_generate", "02_reconstruct", "03_audit", "04_extract_hidden", "05_export")

# what a failing or flagged check means on the embedded run, for the paragraph (a check not named here is
# said by its name)
WHY = {
    "text.roundtrip": "whose ids do not survive decode→encode (SmolLM2 itself emitted non-canonical splits, "
                      "which is what 02 measures as drift)",
    "dataset.distinct_outputs": "whose output equals another prompt's",
    "dataset.unique_sample_id": "whose sample_id another line of its dataset has",
}


def _json(path: Path) -> Any:
    from eagle3data.audit.overview import _json as read

    return read(path)


def _n(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def _checks(counts: dict[str, int]) -> str:
    parts = []
    for name, n in counts.items():
        why = WHY.get(name)
        parts.append(f"{n} {why}" if why else f"{n} failing `{name}`")
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] if parts else ""


def _shown(run_dir: Path) -> str:
    try:
        return str(run_dir.resolve().relative_to(REPO))
    except ValueError:
        return str(run_dir)


def render(run_dir: Path) -> str:
    """The section's markdown (without the markers) from the run's files; raises FileNotFoundError naming the
    first file missing (a stage that did not run)."""
    from eagle3data.audit.overview import hidden_dir_of
    from eagle3data.core.provenance import params_of_run

    shown = _shown(run_dir)
    need = {"stage times": run_dir / "stage_times.json", "01's ledger": run_dir / "ledger.json",
            "03's summary": run_dir / "audit" / "summary.json",
            "04's mix manifest": hidden_dir_of(run_dir) / "mix_manifest.json"}
    files = {k: _json(p) for k, p in need.items()}
    for k, v in files.items():
        if v is None:
            raise FileNotFoundError(f"{need[k]}: {k} is missing or unreadable (run every stage: `make run`)")
    manifests = {p.parent.name: m for p in sorted((run_dir / "export").glob("*/manifest.json")) if (m := _json(p))}
    if not manifests:
        raise FileNotFoundError(f"{run_dir / 'export'}: no hand-off manifest (run stage 05)")
    times, ledger, audit, mix = (files[k] for k in need)
    params = params_of_run(run_dir)

    lines = [f"run '{run_dir.name}' -> {shown}"]
    for stage in [s for s in STAGE_ORDER if s in times] + sorted(set(times) - set(STAGE_ORDER)):
        lines.append(f"  {stage} ... done in {times[stage]} s -> {shown}/notebooks/{stage}.html")
    lines += [f"report: {shown}/report.html", f"outputs: {shown}"]

    sets = ledger["datasets"]
    prompts = sum(d.get("conversations") or d.get("planned") or 0 for d in sets.values())
    multi = [name for name, d in sets.items() if (d.get("conversations") or 0) and d["done"] > d["conversations"]]
    turns = (f"{' and '.join(f'{m}' + chr(39) + 's' for m in multi)} conversations go on turn by turn, "
             f"{sum(sets[m]['done'] - sets[m]['conversations'] for m in multi)} turns more than their prompts; "
             if multi else "")
    failed = {k: c["failed"] for k, c in audit["checks"].items() if c.get("failed")}
    flagged = {k: c["flagged"] for k, c in audit["checks"].items() if c.get("flagged")}
    n_failed, n_flagged = audit.get("records_failed") or 0, audit.get("records_flagged") or 0
    verdict = f"the audit fails {n_failed}: {_checks(failed)}" if n_failed else "the audit fails none"
    if n_flagged:
        verdict += f", and flags {n_flagged}, kept: {_checks(flagged)}"
    tt = next((m["text_trainers"] for m in manifests.values() if isinstance(m.get("text_trainers"), dict)), None)
    text = ""
    if tt and tt.get("reproduced") is not None:
        text = (f"; the text-only trainers' path (the chat template as text, re-encoded) gives other ids for "
                f"{tt['rows'] - tt['reproduced']} of its {tt['rows']} rows")
    para = (f"{_n(prompts, 'prompt')} over the {len(sets)} datasets give {_n(audit['records'], 'record')} with exact "
            f"ids ({turns}{audit.get('records_truncated') or 0} cut at {params.generate.sampling.max_new_tokens} "
            f"tokens, reported as truncated, not broken); {verdict}. The mix keeps {mix['samples']}; 05 hands them to "
            f"both trainers (their own loaders read them: `python bench/check_handoff.py {shown}`){text}.")
    return "```\n" + "\n".join(lines) + "\n```\n\n" + _wrap(para) + "\n"


def _wrap(text: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False))


def section(readme: str) -> tuple[int, int]:
    """Where the section's text lies in the README (between the markers)."""
    a, b = readme.find(BEGIN), readme.find(END)
    if a < 0 or b < a:
        raise ValueError(f"{README}: no `{BEGIN}` ... `{END}` section")
    return a + len(BEGIN) + 1, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", default=str(REPO / "outputs" / "embedded"))
    ap.add_argument("--write", action="store_true", help="rewrite README.md's section from the run")
    ap.add_argument("--readme", default=str(README))
    a = ap.parse_args(argv)
    path, run_dir = Path(a.readme), Path(a.run_dir)
    try:
        new = render(run_dir)
    except (FileNotFoundError, KeyError) as e:
        print(f"README's make-run section not checked: {e}", file=sys.stderr)
        return 2
    text = path.read_text(encoding="utf-8")
    i, j = section(text)
    if text[i:j] == new:
        print(f"{path.name}'s make-run section agrees with {_shown(run_dir)}")
        return 0
    if a.write:
        path.write_text(text[:i] + new + text[j:], encoding="utf-8")
        print(f"{path.name}'s make-run section rewritten from {_shown(run_dir)}")
        return 0
    diff = difflib.unified_diff(text[i:j].splitlines(), new.splitlines(), "README.md", _shown(run_dir), lineterm="", n=0)
    print(f"{path.name}'s make-run section differs from {_shown(run_dir)} "
          f"(`python tools/readme_run.py --write` refreshes it):")
    print("\n".join(list(diff)[2:]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
