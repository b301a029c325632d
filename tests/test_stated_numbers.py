"""Every time and ratio the documentation states comes from a results file.

`benchmarks/claims.json` holds each time and ratio that README.md,
CONTRIBUTING.md and the pages under docs/ state (`about 19 minutes`,
`18 min 53 s`, `0.98–1.04×`, `1.8 ms`, and the bare ratios of
docs/performance.md's tables), each with the machine and the date it was
measured on and where it comes from. The test reads text only, no benchmark
runs, and fails:

- on a number a page states that the claims file does not hold for that
  page: a new or changed number must say where it comes from;
- on a claim that its page no longer states: the file keeps no stale
  number;
- on a claim derived `from` a results table (benchmarks/RESULTS.md,
  benchmarks/RESULTS_tpu.md) or quoted from a results file, whose numbers no
  longer round to what the page states: a benchmark rerun makes the pages
  stale until they say what it measured;
- on a quote (`quotes`) that its results file no longer holds;
- on a measurement without a known machine and a date, and on a stated time
  whose paragraph (or the one before it, a table's or a list's lead-in, or
  the page's first paragraph) does not name its machine.

A measured number that no results file holds (a profile read by hand, a run
whose output was not kept) says so in its claim's `unverified`: the test
cannot check it against anything but the page.

What counts as a stated number: a number or a range or list of them (`1.17 /
1.20 / 1.08`, `0.3–0.9`, `5 to 20`) followed by `×` or by a unit of time
(`ns`, `µs`, `ms`, `s`, `min`, `minutes`, ...), `about a minute`, `~1 min`,
and in the tables of docs/performance.md every decimal number.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLAIMS_FILE = ROOT / "benchmarks" / "claims.json"
CLAIMS = json.loads(CLAIMS_FILE.read_text(encoding="utf-8"))
PAGES = sorted(
    ["README.md", "CONTRIBUTING.md"]
    + [str(path.relative_to(ROOT)) for path in (ROOT / "docs").rglob("*.md")]
)
#: The pages whose tables state ratios without a `×`: every decimal number
#: in their table rows is a stated number.
TABLE_PAGES = {"docs/performance.md"}
#: What a measurement needs and what else a claim may be.
KINDS = {"measured", "target", "limit"}

_NUMBER = r"\d+(?:\.\d+)?"
_LIST = rf"{_NUMBER}(?:\s*(?:–|/|-| to )\s*{_NUMBER})*"
_UNIT = r"(?:ns|µs|ms|s|(?:CPU-)?seconds?|min|(?:CPU-)?minutes?|hours?)"
_TIME = (
    rf"\babout (?:a|an|one|{_NUMBER}) {_UNIT}\b"
    rf"|~\s?{_NUMBER} {_UNIT}\b"
    rf"|(?<![\w.]){_NUMBER} min {_NUMBER} s\b"
    rf"|(?<![\w.]){_LIST} {_UNIT}(?!\w)"
    r"|\b(?:a |one-)minute\b|\bhalf a second\b"
)
_RATIO = rf"(?<![\w.]){_LIST}×(?!\d)"
STATED = re.compile(rf"{_TIME}|{_RATIO}")
TIME = re.compile(_TIME)
TABLE_NUMBER = re.compile(r"(?<![\w.])\d+\.\d+(?:\s*(?:–|/)\s*\d+\.\d+)*(?![\w.])")


@dataclasses.dataclass(frozen=True)
class Stated:
    """A number as a page states it, and the paragraph it is stated in."""

    text: str
    line: int
    context: str


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """`(first line, lines)` of each block of non-blank lines."""
    blocks, current, start = [], [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            if not current:
                start = number
            current.append(line)
        elif current:
            blocks.append((start, current))
            current = []
    if current:
        blocks.append((start, current))
    return blocks


def stated_numbers(text: str, tables: bool = False) -> list[Stated]:
    """Every stated number of a page's `text`: in running text (lines of a
    paragraph joined), in table rows, and with `tables` every decimal number
    of a table's rows."""
    found, previous = [], ""
    blocks = _blocks(text)
    # The page's first paragraph after its title, which may name the machine
    # of every timing on the page.
    intro = " ".join(blocks[1][1]) if len(blocks) > 1 else ""
    for start, lines in blocks:
        paragraph = " ".join(line.strip() for line in lines)
        context = "\n".join((intro, previous, paragraph))
        if all(line.lstrip().startswith("|") for line in lines):
            for offset, line in enumerate(lines):
                if re.fullmatch(r"[|\s:-]+", line):
                    continue
                found += [
                    Stated(match[0], start + offset, context)
                    for match in STATED.finditer(line)
                ]
                if tables and offset > 0:
                    rest = STATED.sub(" ", line)
                    found += [
                        Stated(match[0], start + offset, context)
                        for match in TABLE_NUMBER.finditer(rest)
                    ]
        else:
            pieces = [re.sub(r"\s+", " ", line.strip()) for line in lines]
            starts = list(itertools.accumulate((len(p) + 1 for p in pieces), initial=0))
            for match in STATED.finditer(" ".join(pieces)):
                line = start + bisect.bisect_right(starts, match.start()) - 1
                found.append(Stated(match[0], line, context))
        previous = paragraph
    return found


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def page_numbers(page: str) -> list[Stated]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return stated_numbers(text, tables=page in TABLE_PAGES)


def _claims() -> list[dict]:
    return CLAIMS["claims"]


def _stated(claim: dict) -> list[str]:
    stated = claim["stated"]
    return [stated] if isinstance(stated, str) else list(stated)


def _claimed(page: str) -> dict[str, list[dict]]:
    """`{stated text: [claim, ...]}` of a page: a number stated twice with
    two meanings (a target and a measurement) has a claim for each."""
    claimed: dict[str, list[dict]] = {}
    for claim in _claims():
        if claim["page"] == page:
            for text in _stated(claim):
                claimed.setdefault(_normalized(text), []).append(claim)
    return claimed


# -- results tables ----------------------------------------------------------


def read_table(text: str, after: str) -> list[dict[str, str]]:
    """The first markdown table at or after the first line of `text` that
    holds `after`: its rows as `{column: cell}`; a repeated column name is
    numbered (`median`, `median#2`, ...)."""
    lines = text.splitlines()
    starts = [index for index, line in enumerate(lines) if after in line]
    assert starts, f"no line holds {after!r}"
    index = starts[0]
    while index < len(lines) and not lines[index].lstrip().startswith("|"):
        index += 1
    rows = []
    while index < len(lines) and lines[index].lstrip().startswith("|"):
        cells = lines[index].strip().strip("|").split("|")
        rows.append([cell.strip() for cell in cells])
        index += 1
    assert len(rows) > 2, f"no table after {after!r}"
    header, seen = [], {}
    for name in rows[0]:
        seen[name] = seen.get(name, 0) + 1
        header.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return [dict(zip(header, row, strict=True)) for row in rows[2:]]


def _cell_number(cell: str, part: int | None, number: int) -> str | None:
    if part is not None:
        pieces = cell.split(" / ")
        if part >= len(pieces):
            return None
        cell = pieces[part]
    numbers = re.findall(_NUMBER, cell)
    return numbers[number] if number < len(numbers) else None


def _file_text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def select(selection: dict, read=_file_text) -> list[str]:
    """The numbers (as written) a selection of a claim's `from` names:

    - `{"table": name or [names], "where": {column: value or [values]},
      "column": name, "part": i, "number": j}`: the column of each row that
      matches, in row order (`part`: the `i`th of the cell's ` / `-separated
      values; `number`: its `j`th number, `1.67 (1.65)`'s second);
    - `{"file": path, "quote": text, "pick": [i, ...]}`: the numbers of
      `text`, which the file must hold (whitespace aside);
    - `{"pool": [selection, ...]}`: their numbers together."""
    if "pool" in selection:
        return [value for part in selection["pool"] for value in select(part, read)]
    if "quote" in selection:
        quote = _normalized(selection["quote"])
        assert quote in _normalized(read(selection["file"])), (
            f"{selection['file']} no longer says {quote!r}"
        )
        numbers = re.findall(_NUMBER, quote)
        return [numbers[i] for i in selection.get("pick", range(len(numbers)))]
    names = selection["table"]
    values = []
    for name in [names] if isinstance(names, str) else names:
        table = CLAIMS["tables"][name]
        for row in read_table(read(table["file"]), table["after"]):
            if all(
                row.get(column) in ([want] if isinstance(want, str) else want)
                for column, want in selection.get("where", {}).items()
            ):
                value = _cell_number(
                    row[selection["column"]],
                    selection.get("part"),
                    selection.get("number", 0),
                )
                if value is not None:
                    values.append(value)
    assert values, f"nothing selected by {selection}"
    return values


def _rounds_to(value: str, stated: str) -> bool:
    places = Decimal(stated).as_tuple().exponent
    return Decimal(value).quantize(Decimal(1).scaleb(places), ROUND_HALF_UP) == Decimal(
        stated
    )


def _agrees(part: str, values: list[str]) -> bool:
    """A stated `part` (`a` or `a–b`) and the numbers it is derived from:
    every value rounds to `a`, or the least to `a` and the largest to `b`."""
    numbers = re.findall(_NUMBER, part)
    if len(numbers) == 1:
        return all(_rounds_to(value, numbers[0]) for value in values)
    low, high = numbers
    ordered = sorted(values, key=Decimal)
    return _rounds_to(ordered[0], low) and _rounds_to(ordered[-1], high)


def derivation_errors(claim: dict, read=_file_text) -> list[str]:
    """Where a claim's stated text and the results it is derived from
    disagree: its ` / `-separated parts against its selections one by one,
    or, with one selection, each part against one selected value in order."""
    (stated,) = _stated(claim)
    parts = [part.strip() for part in stated.replace("×", "").split("/")]
    parts = [re.sub(rf"\s*{_UNIT}$", "", part) for part in parts]
    selected = [select(selection, read) for selection in claim["from"]]
    if len(selected) == len(parts):
        pairs = list(zip(parts, selected, strict=True))
    elif len(selected) == 1 and len(selected[0]) == len(parts):
        pairs = [(p, [v]) for p, v in zip(parts, selected[0], strict=True)]
    else:
        return [f"{stated!r}: {len(parts)} parts, selections give {selected}"]
    return [
        f"{claim['page']}: {stated!r} is not what the results say: "
        f"{part!r} from {values}"
        for part, values in pairs
        if not _agrees(part, values)
    ]


# -- the tests ---------------------------------------------------------------


def test_the_scanner_finds_times_ratios_and_table_numbers():
    text = (
        "It takes about 19 minutes (18 min\n53 s), one site 0.98–1.005×,\n"
        "all 1.17 / 1.20 / 1.08×, a 1.8 ms step, compiles of 5 to 20 s.\n"
        "A 2 × 128 batch and 8×8 digits are shapes; 3.11 is a version.\n\n"
        "| model | ratio |\n|---|---|\n| a | 0.987 / 1.003 (device 0.977–1.000) |\n"
    )
    found = [stated.text for stated in stated_numbers(text, tables=True)]
    assert found == [
        "about 19 minutes",
        "18 min 53 s",
        "0.98–1.005×",
        "1.17 / 1.20 / 1.08×",
        "1.8 ms",
        "5 to 20 s",
        "0.987 / 1.003",
        "0.977–1.000",
    ]
    assert [s.text for s in stated_numbers(text)][-1] == "5 to 20 s"


def test_a_rerun_benchmark_makes_the_page_stale():
    """A claim derived from a results table fails once the table holds
    another number: here a rerun's all-sites ratio of Equinox's CNN."""
    results = (
        "# bridge benchmark\n\n| library | model | all sites |\n|---|---|---|\n"
        "| equinox | mlp | 1.153 (1.035) |\n| equinox | cnn | {cnn} |\n"
        "| linen | mlp | 0.992 (0.911) |\n| equinox | transformer | 1.161 (1.212) |\n"
    )
    listed = {
        "page": "docs/performance.md",
        "stated": "1.15 / 1.17 / 1.16×",
        "from": [
            {"table": "cpu", "where": {"library": "equinox"}, "column": "all sites"}
        ],
    }
    ranged = {**listed, "stated": "1.15–1.17×"}
    before = results.format(cnn="1.168 (1.211)")
    after = results.format(cnn="1.198 (1.211)")
    for claim in (listed, ranged):
        assert derivation_errors(claim, read=lambda path: before) == []
        assert derivation_errors(claim, read=lambda path: after)


def test_every_stated_number_is_in_the_claims_file():
    missing = [
        f"{page}:{stated.line}: {stated.text!r}"
        for page in PAGES
        for stated in page_numbers(page)
        if _normalized(stated.text) not in _claimed(page)
    ]
    assert not missing, (
        "add each to benchmarks/claims.json, with its machine, date and "
        "source:\n" + "\n".join(missing)
    )


def test_every_claim_is_stated_on_its_page():
    stale = []
    for page in sorted({claim["page"] for claim in _claims()}):
        assert page in PAGES, page
        stated = {_normalized(s.text) for s in page_numbers(page)}
        stale += [f"{page}: {text!r}" for text in _claimed(page) if text not in stated]
    assert not stale, "no page states these any more:\n" + "\n".join(stale)


def test_every_claim_says_what_it_is_and_every_measurement_where_and_when():
    hosts = CLAIMS["hosts"]
    for claim in _claims():
        kind = claim.get("kind", "measured")
        assert kind in KINDS, claim
        assert claim.get("source"), claim
        if kind == "measured":
            assert claim.get("host") in hosts, claim
            assert re.match(r"\d{4}-\d{2}-\d{2}\b", claim.get("date", "")), claim
        if "from" in claim:
            assert isinstance(claim["stated"], str), claim


def test_the_results_a_claim_quotes_still_say_so():
    """A claim whose number is not a cell of a results table (a wall time in
    a report's header, a ratio computed from rows) quotes what it rests on."""
    gone = [
        f"{claim['page']}: {claim['stated']!r}: {quote['file']} no longer says "
        f"{quote['quote']!r}"
        for claim in _claims()
        for quote in claim.get("quotes", [])
        if _normalized(quote["quote"]) not in _normalized(_file_text(quote["file"]))
    ]
    assert not gone, "\n".join(gone)


@pytest.mark.parametrize(
    "index",
    [i for i, claim in enumerate(CLAIMS["claims"]) if "from" in claim],
    ids=lambda i: CLAIMS["claims"][i]["stated"],
)
def test_a_derived_number_agrees_with_its_results(index):
    errors = derivation_errors(CLAIMS["claims"][index])
    assert not errors, "\n".join(errors)


def test_every_stated_time_names_its_machine():
    """A time (not a ratio) is stated beside the machine it was measured on:
    its paragraph, the one before it, or the page's first paragraph holds
    one of the machine's names, for every measurement it states."""
    hosts = CLAIMS["hosts"]
    unnamed = []
    for page in PAGES:
        claimed = _claimed(page)
        for stated in page_numbers(page):
            if not TIME.fullmatch(stated.text):
                continue
            for claim in claimed.get(_normalized(stated.text), []):
                if claim.get("kind", "measured") != "measured":
                    continue
                names = hosts[claim["host"]]["named_by"]
                if not any(name in stated.context for name in names):
                    unnamed.append(f"{page}:{stated.line}: {stated.text!r} ({names})")
    assert not unnamed, "name the machine beside:\n" + "\n".join(unnamed)
