"""The README's headline table says where each of its numbers was measured, and this keeps it
true: for every row the linked file exists, one of its headings has the link's anchor (the
heading's GitHub slug), and every number of the row's "number" cell, the row's date and the
scripts of its command are in that heading's section, the text from the heading to the next
heading of the same or a higher level; the row's date is the latest date of the section (a
section holds the current measurement of its claim). A number changed on one side only fails
its row; the self-check below changes each number on each side and sees it fail. Every
anchored link between the repository's markdown files resolves too."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
HEADER = "| claim | number | measured | reproduce | where |"
COLUMNS = ("claim", "number", "measured", "reproduce", "where")

NUMBER = re.compile(r"(?<![\w.])(?:[+−](?=\d))?\d(?:[\w.]*\w)?")
"""A number as a reader copies it: digits with their decimal point and any unit letters run
into them (``3m39s``), with a leading ``+`` or ``−``; ``8×80`` is two numbers."""
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
SCRIPT = re.compile(r"[\w./-]+\.(?:py|sh)\b")
WHERE = re.compile(r"\[[^\]]+\]\(([^)#\s]+\.md)#([^)\s]+)\)")
FENCE = re.compile(r"^(?:```|~~~)")
HEADING = re.compile(r"^(#{1,6}) +(.+?)(?: +#+)? *$")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (links by their text, code without backticks)
    lower-cased, every character but letters, digits, ``_``, ``-`` and spaces dropped, spaces
    made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """Anchor -> the section's text (its heading line included), for every heading outside
    fenced code; a repeated anchor gets GitHub's ``-1``, ``-2`` ... suffix."""
    lines = text.splitlines()
    heads: list[tuple[int, int, str]] = []
    seen: dict[str, int] = {}
    fenced = False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            heads.append((i, len(m[1]), base if n == 0 else f"{base}-{n}"))
    out = {}
    for k, (start, level, anchor) in enumerate(heads):
        end = next((i for i, lv, _ in heads[k + 1 :] if lv <= level), len(lines))
        out[anchor] = "\n".join(lines[start:end])
    return out


def occurs(number: str, text: str) -> bool:
    """``number`` stands in ``text`` as a whole number (``0.68`` in ``0.68×``, not in ``0.681``
    nor in ``10.68``)."""
    return re.search(rf"(?<![\w.]){re.escape(number)}(?!\w|\.\d)", text) is not None


def rows(readme: str) -> list[dict[str, str]]:
    """The headline table's body rows, as ``{column: cell}``."""
    assert "\n" + HEADER + "\n" in readme, f"README.md has no table headed {HEADER!r}"
    body = readme.split("\n" + HEADER + "\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    out = []
    for line in body:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        out.append(dict(zip(COLUMNS, cells, strict=True)))
    return out


def problems(row: dict[str, str], read: Callable[[Path], str] = _read) -> list[str]:
    """What of the row its linked section does not hold (empty: all of it)."""
    where = WHERE.fullmatch(row["where"])
    if not where:
        return [f"'where' is not one link to a markdown file's heading: {row['where']}"]
    path, anchor = (README.parent / where[1]).resolve(), where[2]
    if not path.is_file():
        return [f"{where[1]}: no such file"]
    section = sections(read(path)).get(anchor)
    if section is None:
        return [f"{where[1]}#{anchor}: no heading has this anchor"]
    name = f"{where[1]}#{anchor}"
    out = [
        f"{name}: {n} is not there" for n in NUMBER.findall(row["number"]) if not occurs(n, section)
    ]
    dates = DATE.findall(section)
    if row["measured"] not in dates:
        out.append(f"{name}: the date {row['measured']} is not there")
    elif row["measured"] != max(dates):
        out.append(f"{name}: {row['measured']} is not its latest date, {max(dates)}")
    out += [
        f"{name}: {s} is not named there"
        for s in SCRIPT.findall(row["reproduce"])
        if s not in section
    ]
    return out


ROWS = rows(_read(README))


def _id(row: dict[str, str]) -> str:
    return row["claim"][:40]


def test_the_table_is_a_short_list_of_dated_reproducible_numbers():
    assert 5 <= len(ROWS) <= 7, len(ROWS)
    for row in ROWS:
        assert NUMBER.findall(row["number"]), row["claim"]
        assert DATE.fullmatch(row["measured"]), row["measured"]
        assert row["reproduce"].startswith("`") and SCRIPT.search(row["reproduce"]), row["claim"]


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_every_number_and_date_is_in_the_linked_section(row):
    assert problems(row) == []


def _changed(number: str, text: str) -> str:
    """``number`` with one digit changed, into a number that does not stand in ``text``."""
    digits = [i for i, c in enumerate(number) if c.isdigit()]
    for i in reversed(digits):
        for step in range(1, 10):
            new = number[:i] + str((int(number[i]) + step) % 10) + number[i + 1 :]
            if not occurs(new, text):
                return new
    raise AssertionError(f"no change of {number} is absent from the text")


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_a_number_changed_on_one_side_only_fails(row):
    """The check is not vacuous: each number changed in the README, or in the document, and
    the date changed in the README, each make the row fail."""
    path = (README.parent / WHERE.fullmatch(row["where"])[1]).resolve()
    doc = _read(path)
    section = sections(doc)[WHERE.fullmatch(row["where"])[2]]
    for number in NUMBER.findall(row["number"]):
        new = _changed(number, section)
        pattern = re.compile(rf"(?<![\w.]){re.escape(number)}(?!\w|\.\d)")
        in_readme = {**row, "number": pattern.sub(new, row["number"])}
        assert problems(in_readme), f"README's {number} -> {new} went unnoticed"
        in_doc = pattern.sub(new, doc)
        assert problems(row, lambda p, in_doc=in_doc: in_doc if p == path else _read(p)), (
            f"{path.name}'s {number} -> {new} went unnoticed"
        )
    other_day = {**row, "measured": _changed(row["measured"], section)}
    assert problems(other_day)


def test_the_parsers_on_a_made_up_table():
    """Slugs, sections and whole numbers as GitHub and a reader see them."""
    assert slug("1. Peak memory; best (2026-12-05)") == "1-peak-memory-best-2026-12-05"
    assert (
        slug("The 27B example (`examples/h100_8gpu/x.sh`)")
        == "the-27b-example-examplesh100_8gpuxsh"
    )
    assert slug("What fits my node: `--fit`") == "what-fits-my-node---fit"
    doc = "# T\n\n## A\n\nx 1.5 %\n\n```\n# not a heading\n```\n\n### A.1\n\n3m39s\n\n## A\n\n2.0\n"
    got = sections(doc)
    assert set(got) == {"t", "a", "a1", "a-1"}
    assert "3m39s" in got["a"] and "2.0" not in got["a"] and "# not a heading" in got["a"]
    assert NUMBER.findall("0.953 ± 0.016 (−2.5 %), 0.68× 8×80 3m39s; 1.") == [
        "0.953",
        "0.016",
        "−2.5",
        "0.68",
        "8",
        "80",
        "3m39s",
        "1",
    ]
    assert (
        occurs("0.68", "at 0.68× its")
        and not occurs("0.68", "0.681")
        and not occurs("0.68", "10.68")
    )
    assert occurs("2.5", "(−2.5 %)") and not occurs("2.5", "2.55") and occurs("1.5", "is 1.5.")


MARKDOWN = [
    README,
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").rglob("*.md")),
]
ANCHORED = re.compile(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)")


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_anchored_links_between_the_documents_resolve(path):
    """A section renamed or removed leaves no link pointing at it."""
    broken = []
    for m in ANCHORED.finditer(_read(path)):
        target = (path.parent / m[1]).resolve() if m[1] else path
        if not target.is_file() or m[2] not in sections(_read(target)):
            broken.append(m[0][2:-1])
    assert not broken, broken
