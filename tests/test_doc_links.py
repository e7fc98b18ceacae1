"""Every relative link in README.md, docs/*.md and docs/bench/README.md names a file or folder that exists (as does
every image a bench report under docs/bench embeds), and every #anchor into a markdown file names one of its
headings (GitHub's heading ids).  Pure file checks."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "bench" / "README.md"]
LINK = re.compile(r"\]\(([^()\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _lines(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    ids = set()
    for _, line in _lines(path):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        base = _anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def _links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in _lines(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # not inside inline code
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            yield number, target


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for number, target in _links(doc):
        name, _, fragment = target.partition("#")
        dest = (doc.parent / unquote(name)).resolve() if name else doc
        if not dest.exists():
            broken.append(f"{number}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{number}: {target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_bench_reports_embed_only_plots_that_were_kept() -> None:
    """A bench report under docs/bench links its PNG plots; where they were not kept (size), it says so instead."""
    image = re.compile(r"!\[[^\]]*\]\(([^()\s]+)\)")
    broken = [f"{report.relative_to(ROOT)}:{number}: {target}"
              for report in sorted((ROOT / "docs" / "bench").rglob("*.md"))
              for number, line in _lines(report) for target in image.findall(line)
              if not (report.parent / unquote(target)).exists()]
    assert not broken, "\n".join(broken)
