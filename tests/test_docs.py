"""The documents hold together: every relative link in README.md, docs/ and docs/lab/ points at a file of the
repository (and, with #anchor, at one of its headings), none points outside the repository, the README and
PERFORMANCE stay short, and dated measurement logs live in docs/lab/, indexed there, not in the user docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "lab").glob("*.md"))]
USER_DOCS = [ROOT / "README.md", *(ROOT / "docs" / name for name in ("USAGE.md", "PERFORMANCE.md", "RECIPES.md"))]
LAB = ROOT / "docs" / "lab"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # not headings in code
    return [m.group(1) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)]


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in headings(path)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m.group(1))]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_resolves(doc):
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.is_relative_to(ROOT) or ".." in Path(file).parts and not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_the_architecture_and_the_code_cite_nothing_outside_the_repository():
    """The workplace's shared folder (offline data, notes) is not part of the project: the architecture and the
    code explain themselves without it."""
    for doc in [ROOT / "docs" / "ARCHITECTURE.md", *ROOT.joinpath("src").rglob("*.py")]:
        assert "../shared" not in doc.read_text(encoding="utf-8"), f"{doc.relative_to(ROOT)} cites ../shared"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_performance_is_a_users_page_not_a_notebook():
    assert len((ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("doc", USER_DOCS, ids=[str(d.relative_to(ROOT)) for d in USER_DOCS])
def test_no_dated_heading_outside_the_lab(doc):
    """A heading with a date is a session's log: it goes to a dated file in docs/lab/, the user doc keeps the
    current figure and links it."""
    dated = [h for h in headings(doc) if re.search(r"\b20\d\d-\d\d-\d\d", h)]
    assert not dated, f"{doc.relative_to(ROOT)}: dated headings {dated}; move them to docs/lab/"


def test_every_lab_file_is_dated_and_indexed():
    index = (LAB / "README.md").read_text(encoding="utf-8")
    for log in sorted(LAB.glob("*.md")):
        if log.name == "README.md":
            continue
        assert re.match(r"20\d\d-\d\d-\d\d-[a-z0-9-]+\.md$", log.name), f"{log.name}: name it YYYY-MM-DD-machine.md"
        first = log.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# "), f"docs/lab/{log.name} starts with a one-line heading"
        assert f"]({log.name})" in index, f"docs/lab/{log.name} is not in docs/lab/README.md"
