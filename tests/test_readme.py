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
