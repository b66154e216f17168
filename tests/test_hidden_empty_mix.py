"""An empty training mix is a failed 04 (issue 52's rule: 04 does not exit 0 when it stored nothing usable), and 05
refuses it: a hand-off of 0 rows is never written.

A run whose every record failed 03's audit: `run_extract` raises MixEmpty in one line naming the mix manifest and the
drop reasons with their counts, and merges no index; `eagle3data extract` and `eagle3data run --only 04 --only 05`
exit 1 with that line (05 never starts); `eagle3data export` refuses (exit 2, one line) and writes nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from eagle3data.core.params import load_params
from eagle3data.export.run import ExportError, export_format
from eagle3data.hidden.extract import run_extract
from eagle3data.hidden.mix import MANIFEST_FILE, hidden_dir, read_mix
from eagle3data.hidden.store.failures import MixEmpty
from eagle3data.hidden.store.format import INDEX_FILE, INFO_FILE, shard_dir

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "params" / "ci.yaml"
OVER = {"hidden.probe_batches": 0, "hidden.verify_after": False, "export.allow_unverified": True,
        "export.draft_vocab_size": 64}


@pytest.fixture(autouse=True)
def one_worker(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def all_failed(ci_run, root: Path) -> int:
    """A copy of the ci run (01 done) under `root/ci` whose 03 failed every record; the number of records."""
    shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
    rows = [orjson.loads(x) for f in sorted((root / "ci" / "records").glob("*.jsonl")) for x in f.read_bytes().splitlines()]
    (root / "ci" / "audit").mkdir()
    (root / "ci" / "audit" / "verdicts.jsonl").write_bytes(b"".join(
        orjson.dumps({"dataset": r["dataset"], "sample_id": r["sample_id"], "turn": r.get("turn"),
                      "failed": ["ends_with_end_of_turn"], "truncated": False}) + b"\n" for r in rows))
    return len(rows)


def cli_overrides() -> list[str]:
    return [a for k, v in OVER.items() for a in ("-p", k, str(v).lower() if isinstance(v, bool) else str(v))]


def the_line(n: int, hdir: Path) -> str:
    return (f"04: the mix is empty: {n} records, all dropped (audit_failed {n}): see {hdir / MANIFEST_FILE}; "
            "no index merged, nothing to export")


def test_an_empty_mix_fails_04_in_one_line_and_05_refuses(ci_run, tmp_path, capsys):
    from eagle3data.cli import main

    n = all_failed(ci_run, tmp_path)
    p = load_params(CI, {"output_root": str(tmp_path), **OVER})
    hdir = hidden_dir(p)
    with pytest.raises(MixEmpty) as e:
        run_extract(p, progress=False)
    assert str(e.value) == the_line(n, hdir) and e.value.status == 1
    assert read_mix(hdir).samples == [] and read_mix(hdir).manifest["dropped_counts"]["b1_glaive"]["audit_failed"] >= 1
    assert not (hdir / INDEX_FILE).exists() and not (hdir / INFO_FILE).exists() and not shard_dir(hdir).exists()

    # the headless stage: exit 1, the one line on stderr
    capsys.readouterr()
    assert main(["extract", str(CI), "-p", "output_root", str(tmp_path), *cli_overrides()]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: " + the_line(n, hdir) and not (hdir / INDEX_FILE).exists()

    # 05 refuses the empty mix in one line, writing nothing (API and command line: exit 2)
    with pytest.raises(ExportError) as x:
        export_format(p, tmp_path / "out", "specforge")
    assert str(x.value) == (f"05: nothing to export: the mix is empty: {n} records, all dropped (audit_failed {n}): "
                            f"see {hdir / MANIFEST_FILE}")
    assert not (tmp_path / "out").exists()
    assert main(["export", str(p.run_dir), "--format", "speculators_online", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "05: nothing to export: the mix is empty" in err and not (tmp_path / "o2").exists()

    # without 04's mix, 05 builds it with the same rule and refuses it the same way
    shutil.rmtree(hdir)
    with pytest.raises(ExportError, match=re.escape(f"05: nothing to export: the mix is empty: {n} records, all dropped "
                                                    f"(audit_failed {n}): see the mix built here")):
        export_format(p, tmp_path / "out3", "specforge")
    assert not (tmp_path / "out3").exists()


def test_eagle3data_run_fails_at_04_on_an_empty_mix_and_never_exports(ci_run, tmp_path):
    n = all_failed(ci_run, tmp_path)
    cmd = [sys.executable, "-m", "eagle3data", "run", str(CI), "-p", "output_root", str(tmp_path),
           *cli_overrides(),
           "--only", "04", "--only", "05", "--progress-every", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert "\n" not in err, err
    assert err.startswith("error: 04_extract_hidden failed: MixEmpty: " + the_line(n, tmp_path / "ci" / "hidden")), err
    assert "05_export" not in proc.stdout and not (tmp_path / "ci" / "export").exists()
    assert not (tmp_path / "ci" / "hidden" / INDEX_FILE).exists()
