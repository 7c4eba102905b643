"""The README's shape, where it is cheap to hold: a newcomer reads what the service does, how to start it, how to
call it and how to deploy it before the figures, the tests and the rest; the figures fit on a screen, name their
machine, come from runs that record it and are the values of the keys each row names; the batches are the
benchmarks'; the call examples are there (tests/system/test_docs.py runs them against a server and compares what
they print).

Which commands the README's blocks may name bare, and the install's steps: tests/system/test_install.py."""

from __future__ import annotations

import json
import re
import shlex

from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.service.codec import build_chunk_response_bytes
from testkit.batches import make_inputs
from testkit.paths import REPO
from tests.deploy.support import markdown_anchors
from tests.system.test_docs import blocks
from tests.system.test_results_summary import check_figures, shown_numbers

README = REPO / "README.md"
TEXT = README.read_text()
RESULTS = REPO / "benchmarks" / "results"

# The sections a newcomer reads, in this order (others may come between or after them).
ORDER = ["Quick start", "Calling it", "Deploy", "Performance", "Tests"]
MAX_ROWS, MAX_CELL = 12, 120
# Below the headline table, a comment names the keys of each row's figures, one line a row, written as RESULTS.md's
# last column writes them (```results/FILE.json` `PREFIX`: `KEY`, ...``).
ROW_KEYS = re.compile(r"^<!-- The figures of each row above[^`]*?\n((?:`results/[^\n]*\n)+)-->$", re.M)


def section(title: str) -> str:
    (body,) = re.findall(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", TEXT, re.M | re.S)
    return body


def first_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The first table of ``text``: its header's cells and its rows' cells."""
    lines = re.search(r"^(\|.*\n)+", text, re.M).group(0).splitlines()
    header, _rule, *rows = [[cell.strip() for cell in line.strip()[1:-1].split("|")] for line in lines]
    return header, rows


def test_what_it_does_comes_first_then_the_sections_in_order() -> None:
    intro = TEXT.split("\n## ", 1)[0]
    assert all(word in intro for word in ("scheduler", "BuildChunk", "PlanBatch", "[ks, ke)")), intro
    titles = re.findall(r"^## (.+)$", TEXT, re.M)
    assert [title for title in titles if title in ORDER] == ORDER, titles


def test_make_serve_and_make_test_are_the_first_two_commands() -> None:
    """The first thing a newcomer runs; .ci/run runs the README's test command."""
    first = blocks(README)[0]
    commands = [words for words in map(lambda line: shlex.split(line, comments=True), first.body.splitlines()) if words]
    assert commands[:2] == [["make", "serve"], ["make", "test"]], commands


def test_the_headline_table_fits_on_a_screen_and_names_the_machine_of_each_row() -> None:
    header, rows = first_table(section("Performance"))
    assert 0 < len(rows) <= MAX_ROWS, f"{len(rows)} rows: at most {MAX_ROWS}"
    assert len(header) == len({*header}) and "machine" in header, header
    for row in rows:
        assert len(row) == len(header), row
        assert not [cell for cell in row if len(cell) > MAX_CELL], f"a cell over {MAX_CELL} characters in {row}"
        assert row[header.index("machine")], f"a row that names no machine: {row}"


def test_each_headline_figure_cites_a_run_that_records_its_commit_date_and_machine() -> None:
    header, rows = first_table(section("Performance"))
    column = header.index("run (commit, date)")
    for row in rows:
        cited = re.fullmatch(r"`([\w.-]+\.json)` \(([0-9a-f]{7,}), (\d{4}-\d\d-\d\d)\)", row[column])
        assert cited, f"a row that cites no run as `NAME.json` (commit, date): {row}"
        name, commit, date = cited.groups()
        run = json.loads((RESULTS / name).read_text()).get("run", {})
        assert {"commit", "date", "host", "cpu_model"} <= set(run), f"{name} has no run record"
        assert run["commit"].startswith(commit) and run["date"].startswith(date), (row, run)


def test_each_headline_figure_is_the_value_of_the_key_its_row_names() -> None:
    """Every number of a row's result and then its baseline, as rounded there (a % is the value times 100), is in
    order the value of one key its line of the comment below the table names, in the JSON the row cites
    (RESULTS.md's check, ``check_figures``): a figure copied wrong, bound to another key of the same file (a 100 %
    that is some other ratio's 1.0), or left behind when its file was replaced fails here."""
    header, rows = first_table(section("Performance"))
    keys = ROW_KEYS.search(section("Performance"))
    assert keys, "no comment below the headline table names the keys of its rows' figures"
    lines = keys.group(1).splitlines()
    assert len(lines) == len(rows), f"{len(rows)} rows, {len(lines)} lines of keys"
    shown = [header.index("result"), header.index("baseline, same run")]
    for number, (row, line) in enumerate(zip(rows, lines, strict=True), 1):
        where = f"README.md, headline row {number} ({row[0]})"
        figures = [figure for column in shown for figure in shown_numbers(row[column])]
        (cited,) = re.findall(r"`([\w.-]+\.json)`", row[header.index("run (commit, date)")])
        assert check_figures(where, line, figures) == cited, f"{where}: cites {cited}, its keys are another file's"


def test_the_batches_are_the_ones_the_benchmarks_send() -> None:
    """The Performance section's small, medium and large: their requests and query tokens as testkit.batches makes
    them, and their answers' sizes as the server encodes them (KB and MB of 1,000 and 1,000,000 bytes, as rounded
    there)."""
    text = " ".join(section("Performance").split())
    for name, batch in (("small", "small-8"), ("medium", "medium-64"), ("large", "large-256")):
        inputs = make_inputs(batch)
        answer = len(build_chunk_response_bytes(build_chunk_metadata_numpy(inputs), omit_token_to_seq=False))
        stated = re.search(
            rf"\*\*{name}\*\* = ([\d,]+) requests, ([\d,]+) query tokens \((?:an? )?(\d+(?:\.\d+)?) (KB|MB)\b", text
        )
        assert stated, f"the Performance section does not define **{name}** as N requests, N query tokens (N KB|MB)"
        requests, tokens, size, unit = stated.groups()
        assert (int(requests.replace(",", "")), int(tokens.replace(",", ""))) == (
            len(inputs.seq_lens),
            int(inputs.query_start_loc[-1]),
        ), name
        decimals = len(size.partition(".")[2])
        assert round(answer / {"KB": 1e3, "MB": 1e6}[unit], decimals) == float(size), f"{name}: {answer} bytes"


def test_one_call_example_each_for_python_grpcurl_and_curl_runs_against_a_server() -> None:
    calling = section("Calling it")
    examples = [
        block
        for block in blocks(README)
        if block.marker == "<!-- doc: run against a server -->" and f"```{block.lang}\n{block.body}```" in calling
    ]
    tools = sorted(b.lang if b.lang == "python" else shlex.split(b.body)[0].rsplit("/", 1)[-1] for b in examples)
    assert tools == ["curl", "grpcurl", "python"], tools


def test_every_link_into_a_section_finds_it() -> None:
    """A link to a heading of this README or of a document beside it goes where it says: headings are renamed
    when their code moves."""
    links = re.findall(r"\]\(([^)#:\s]*)#([\w-]+)\)", re.sub(r"```.*?```", "", TEXT, flags=re.S))
    assert links
    for target, anchor in links:
        document = (REPO / target) if target else README
        assert anchor in markdown_anchors(document.read_text()), f"{target}#{anchor}: no such heading"
