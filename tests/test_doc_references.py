"""Code, configs, tests and scripts cite docs/ARCHITECTURE.md by section, never the design
notes outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREES = ("pdflow", "kernels", "conf", "tests", "scripts")
SECTIONS = ("Packages", "Data flow", "KV units, pages and the head cut",
            "The P/D request path", "Drafters", "Invariants")
OUTSIDE_DOC = "DES" + "IGN"  # spelled apart so this file does not cite it
CITATION = re.compile(r"ARCHITECTURE\.md,\s+'([^']+)'")


def _sources():
    for tree in TREES:
        for path in (REPO / tree).rglob("*"):
            if path.suffix in (".py", ".yaml", ".sh", ".toml") and path.name != Path(__file__).name:
                yield path, path.read_text()


def _cited_sections(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return [m.group(1) for m in CITATION.finditer(flat)]


def test_nothing_cites_the_design_notes_outside_the_repository():
    hits = [f"{p.relative_to(REPO)}:{i}" for p, text in _sources()
            for i, line in enumerate(text.splitlines(), 1) if OUTSIDE_DOC in line]
    assert not hits, f"cite docs/ARCHITECTURE.md with a section instead: {hits}"


def test_every_citation_names_a_section_of_the_architecture_doc():
    assert _cited_sections("see docs/ARCHITECTURE.md, 'KV units,\n pages'") == ["KV units, pages"]
    doc = REPO / "docs" / "ARCHITECTURE.md"
    headings = SECTIONS
    if doc.exists():  # the doc's own headings, once it is in the tree
        headings = tuple(re.sub(r"^#+\s*(\d+\.\s*)?", "", h).strip()
                         for h in doc.read_text().splitlines() if h.startswith("#"))
    cited = {(s, str(p.relative_to(REPO))) for p, text in _sources() for s in _cited_sections(text)}
    assert cited, "no citations found: the pattern is wrong"
    unknown = sorted((s, p) for s, p in cited if s not in headings)
    assert not unknown, f"sections not in docs/ARCHITECTURE.md {headings}: {unknown}"
