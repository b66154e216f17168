"""The README a newcomer reads in five minutes: under 200 lines, its two commands, and every relative link of it
and of docs/ landing on a file that exists (and, for `file.md#anchor`, on a heading of that file, by GitHub's
anchor rules), so the reference material moved out of the README stays reachable."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, REPO / "engines" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (markdown marks and link targets dropped), lower-cased, every
    character but letters, marks, digits, `_`, `-` and spaces removed, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(c for c in text.strip().lower()
                   if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (a repeated slug gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """The relative links of a page that land nowhere: a missing file, or a missing heading of a markdown file."""
    bad = []
    for lineno, line in enumerate(_prose(page.read_text(encoding="utf-8")), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = page if not path else (page.parent / path).resolve()
            where = f"{page.relative_to(root)}:{lineno}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
                bad.append(f"{where} (no heading '{anchor}' in {dest.relative_to(root)})")
    return bad


def test_readme_is_short_and_names_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200, f"README.md is {len(text.splitlines())} lines: move reference material to docs/"
    quick = text[text.index("## Quick start"):text.index("\n## ", text.index("## Quick start") + 1)]
    block = quick[quick.index("```bash"):quick.index("```", quick.index("```bash") + 3)]
    commands = [ln.split("#")[0].strip() for ln in block.splitlines()[1:] if ln.split("#")[0].strip()]
    assert commands == ["make run", "make test"], commands


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_lands(page):
    assert broken_links(page) == []


def test_link_check_catches_a_broken_link_and_a_missing_heading(tmp_path):
    """The checker itself: a link to a missing file, or to a heading the target lacks, is reported; GitHub's
    slugs for headings with code, punctuation and a repeat are matched."""
    page, other = tmp_path / "a.md", tmp_path / "b.md"
    other.write_text("# B\n## 2a. Which backend (`hidden.backend: hf | vllm`)\n## Use\n## Use\n"
                     "```bash\n# not a heading\n```\n## 06 · What the data is worth\n", encoding="utf-8")
    page.write_text("[ok](b.md#2a-which-backend-hiddenbackend-hf--vllm) [ok](b.md#use-1) [ok](#title)\n"
                    "[ok](b.md#06--what-the-data-is-worth) `[in code](nowhere.md)` [web](https://x.org/y)\n"
                    "# Title\n[gone](missing.md) [no heading](b.md#not-a-heading) [bad](b.md#no-such)\n",
                    encoding="utf-8")
    bad = broken_links(page, tmp_path)
    assert bad == ["a.md:4: missing.md (no such file)", "a.md:4: b.md#not-a-heading (no heading 'not-a-heading' in b.md)",
                   "a.md:4: b.md#no-such (no heading 'no-such' in b.md)"], bad


def _run_files(run_dir: Path, failed: int = 2) -> None:
    """The files of a run that README's make-run section reads, as the stages write them (keys as in
    `eagle3data.audit.overview`, which reads them for the report's summary)."""
    import json

    from eagle3data.core.params import load_params
    from eagle3data.core.provenance import write_provenance

    def put(rel: str, data: dict) -> None:
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(json.dumps(data))

    write_provenance(run_dir, "03_audit", load_params(REPO / "params" / "embedded.yaml"))
    put("stage_times.json", {"01_generate": 54, "02_reconstruct": 7, "03_audit": 12, "04_extract_hidden": 24,
                             "05_export": 6})
    put("ledger.json", {"status": "finished", "datasets": {
        "a": {"planned": 3, "done": 3, "conversations": 0},
        "b": {"planned": 4, "done": 4, "conversations": 2}}})
    checks = {"output.single_eot": {"failed": 0, "flagged": 0, "applicable": 7},
              "text.roundtrip": {"failed": 0, "flagged": 3, "applicable": 7},
              "dataset.distinct_outputs": {"failed": failed, "flagged": 0, "applicable": 7}}
    put("audit/summary.json", {"records": 7, "records_failed": failed, "records_flagged": 3, "records_truncated": 4,
                               "checks": checks})
    put("hidden/mix_manifest.json", {"samples": 7 - failed, "datasets": {}})
    put("export/speculators_online/manifest.json", {"exported": 7 - failed, "text_trainers": {"rows": 5,
                                                                                              "reproduced": 2}})


def test_readmes_make_run_section_is_rendered_from_the_run_and_checked(tmp_path, capsys):
    """README's `make run` block and paragraph come from the run's own files (`tools/readme_run.py`): each
    stage's printed time, the prompts, records, truncated, the audit's failures and flags by check, what the mix
    kept and what the text-only trainers' path re-encodes differently. The check says where README and the run
    part (exit 1), `--write` refreshes the section, and then the check agrees."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_run", REPO / "tools" / "readme_run.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    run_dir = tmp_path / "embedded"
    _run_files(run_dir)
    text = tool.render(run_dir)
    assert f"  02_reconstruct ... done in 7 s -> {run_dir}/notebooks/02_reconstruct.html" in text
    para = " ".join(text.split("```")[-1].split())
    assert para.startswith("5 prompts over the 2 datasets give 7 records with exact ids (b's conversations go on "
                           "turn by turn, 2 turns more than their prompts; 4 cut at 128 tokens"), para
    assert "the audit fails 2: 2 whose output equals another prompt's, and flags 3, kept: 3 whose ids do not " \
           "survive decode→encode" in para and "The mix keeps 5;" in para and "other ids for 3 of its 5 rows." in para

    readme = tmp_path / "README.md"
    readme.write_text(README.read_text(encoding="utf-8"))  # README itself has the section
    assert tool.main([str(run_dir), "--readme", str(readme)]) == 1
    assert "differs from" in capsys.readouterr().out
    assert tool.main([str(run_dir), "--readme", str(readme), "--write"]) == 0
    assert tool.main([str(run_dir), "--readme", str(readme)]) == 0 and text in readme.read_text()
    before = readme.read_text()
    assert before.split(tool.END)[1] == README.read_text(encoding="utf-8").split(tool.END)[1]  # the rest is kept
    _run_files(run_dir, failed=0)
    assert tool.main([str(run_dir), "--readme", str(readme)]) == 1
    out = capsys.readouterr().out
    assert "differs from" in out and "\n-" in out and "\n+" in out
    assert "the audit fails none, and flags 3" in " ".join(tool.render(run_dir).split())
    (run_dir / "hidden" / "mix_manifest.json").unlink()
    assert tool.main([str(run_dir), "--readme", str(readme)]) == 2
    assert "mix_manifest.json: 04's mix manifest is missing" in capsys.readouterr().err
