"""Design citations resolve to the design document the repository ships, docs/architecture.md.

A citation is the section sign followed by a heading key (the part of a heading before its " — ",
one word: `§Layers`, `§Quarantine`, `§H2`), or a bare hazard id (H1, H2, …) or invariant id (I1, I2,
…), which must be a heading key too. Mentions of design documents the repository does not ship
(the working notes it was built from) are dangling by definition. Scanned: every .py and .md file
under src/, benchmarks/, tests/, tools/ and docs/, the README and .ci/run.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SCANNED_DIRS = ("src", "benchmarks", "tests", "tools", "docs")
SCANNED_FILES = ("README.md", ".ci/run")
SUFFIXES = (".py", ".md")

SECTION_SIGN = "\u00a7"
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$")
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9-]*")
# The token after a section sign, up to whitespace or punctuation that cannot be part of a key.
_CITATION = re.compile(SECTION_SIGN + r"([A-Za-z0-9.\-]*)")
_ID = re.compile(r"\b([HI][1-9])\b")
# Working notes the project was built from; spelled in pieces so this file does not cite them.
_UNSHIPPED = re.compile(
    r"DESIGN\.md|\bDESIGN " + SECTION_SIGN + r"|kv-" + r"behaviour|landscape\.md"
)


def heading_keys(markdown: str) -> Counter[str]:
    """Citable keys of `markdown`'s headings (outside code fences), with how often each occurs."""
    keys: Counter[str] = Counter()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m is None:
            continue
        key = m.group(2).split(" — ")[0].strip()
        if _KEY.fullmatch(key):
            keys[key] += 1
    return keys


def dangling(text: str, keys: set[str]) -> list[tuple[int, str]]:
    """(line number, reference) for every citation in `text` that names no key in `keys`."""
    found: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        for m in _CITATION.finditer(line):
            token = m.group(1).rstrip(".-")
            if token not in keys:
                found.append((number, SECTION_SIGN + token))
        found += [(number, m.group(1)) for m in _ID.finditer(line) if m.group(1) not in keys]
        found += [(number, m.group(0)) for m in _UNSHIPPED.finditer(line)]
    return found


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for top in SCANNED_DIRS:
        files += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in SUFFIXES and p.is_file())
    return files


def test_headings_are_unique_and_name_every_hazard_and_invariant() -> None:
    keys = heading_keys(DOC.read_text())
    repeated = sorted(k for k, n in keys.items() if n > 1)
    assert not repeated, f"docs/architecture.md: heading keys used twice: {repeated}"
    expected = {f"H{i}" for i in range(1, 8)} | {f"I{i}" for i in range(1, 6)}
    assert expected <= set(keys), f"missing headings: {sorted(expected - set(keys))}"
    assert {"Layers", "Hazards", "Invariants", "Vocabulary", "Noticed"} <= set(keys)


def test_every_citation_names_a_heading_of_the_architecture_document() -> None:
    keys = set(heading_keys(DOC.read_text()))
    problems = [
        f"{path.relative_to(ROOT)}:{number}: {ref}"
        for path in scanned_files()
        for number, ref in dangling(path.read_text(encoding="utf-8", errors="replace"), keys)
    ]
    assert not problems, (
        "references that name no heading of docs/architecture.md (cite `architecture.md "
        + SECTION_SIGN
        + "Key` with an existing heading key, or add the section):\n"
        + "\n".join(problems)
    )


def test_the_check_reports_each_dangling_reference_with_its_line() -> None:
    s, h9, i8, design = SECTION_SIGN, "H" + "9", "I" + "8", "DESIGN" + ".md"  # not literal here
    text = "\n".join(
        [
            f"fine: architecture.md {s}Layers, {s}H2, H7 and I5.",
            f"numbered: reference {s}8.2 and {s}5",
            f"unknown ids: {h9}, {i8}; not ids: H100, SHA1, HI2",
            f"gone: see {design}",
            f"bare sign: {s} alone",
        ]
    )
    keys = {"Layers", "H2", "H7", "I5"}
    assert dangling(text, keys) == [
        (2, f"{s}8.2"),
        (2, f"{s}5"),
        (3, h9),
        (3, i8),
        (4, design),
        (5, s),
    ]


def test_heading_keys_are_the_part_before_the_dash_and_skip_code_fences() -> None:
    markdown = (
        "# Title words\n## Layers — what\n### H2 — a hazard\n```\n## Fenced\n```\n## Two words\n"
    )
    assert heading_keys(markdown) == Counter({"Layers": 1, "H2": 1})
