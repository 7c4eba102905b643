"""benchmarks/RESULTS.md is what its JSON files say.

Every table row of RESULTS.md names, in its last column, a JSON file under benchmarks/results/ and the keys its
figures come from: ``results/FILE.json`` ``PREFIX``: ``KEY``, ``KEY``, ... (a key ``a/b`` is the ratio of two). Every
number shown in the columns between "command" and "machine" is, in order, one key's value, rounded as shown (a
figure in % is the value times 100). The commit and date are the file's run record's (``run``); a file without one
says so, and its commit and date are those of the commit that wrote it (from git, where the checkout has history).
The machine names the run record's CPU model, the CPUs the benchmark and each pinned process ran on, and its GPUs
(or "no GPU"). So a figure that drifts from its file, a file removed or a key renamed fails here.

benchmarks/history.md, the dated notebook, keeps the removed files' names and the commit each can be read at.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from indexer_service.service.process import cgroups
from testkit import record as record_module
from testkit.batches import make_inputs
from testkit.harness import FAST_START, ServiceProcess
from testkit.paths import REPO
from testkit.record import note_pinned, process_name, run_record

BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
SUMMARY = BENCHMARKS / "RESULTS.md"
HISTORY = BENCHMARKS / "history.md"
MAX_LINES = 60

_NUMBER = re.compile(r"(?<![\w.])(-?\d[\d,]*(?:\.\d+)?)(\s?%)?")
_CODE = re.compile(r"`([^`]+)`")
_JSON_CELL = re.compile(r"^`results/(?P<file>[\w.-]+\.json)`(?: `(?P<prefix>[^`]+)`)?: (?P<keys>.+)$")
_COMMIT_CELL = re.compile(r"^`(?P<commit>[0-9a-f]{7,40})` (?P<date>\d{4}-\d\d-\d\d)(?P<note>.*)$")
NO_RUN_RECORD = "no run record"


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> list[tuple[list[str], list[tuple[int, list[str]]]]]:
    """Each Markdown table: its header's cells and its rows (line number, cells)."""
    found, lines = [], text.splitlines()
    n = 0
    while n < len(lines):
        if lines[n].startswith("|") and n + 1 < len(lines) and set(lines[n + 1].replace("|", "").strip()) <= {"-"}:
            header, rows, n = cells(lines[n]), [], n + 2
            while n < len(lines) and lines[n].startswith("|"):
                rows.append((n + 1, cells(lines[n])))
                n += 1
            found.append((header, rows))
        else:
            n += 1
    return found


def value_at(data: object, path: str) -> object:
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def key_value(data: object, prefix: str, key: str) -> float:
    """A key's value under ``prefix``; ``a/b`` is a's over b's."""
    full = [f"{prefix}.{part}" if prefix else part for part in key.split("/")]
    values = [float(value_at(data, path)) for path in full]
    return values[0] / values[1] if len(values) == 2 else values[0]


def shown_numbers(text: str) -> list[tuple[float, int, bool]]:
    """The numbers a cell shows: value, decimals, whether in %."""
    return [
        (float(number.replace(",", "")), len(number.split(".")[1]) if "." in number else 0, bool(percent))
        for number, percent in _NUMBER.findall(text)
    ]


def check_figures(where: str, json_cell: str, shown: list[tuple[float, int, bool]]) -> str:
    """Each figure ``shown`` (:func:`shown_numbers`) is, in order, the value of one key that ``json_cell`` names
    (```results/FILE.json` `PREFIX`: `KEY`, ...``), rounded as shown; returns the file's name."""
    cell = _JSON_CELL.match(json_cell)
    assert cell, f"{where}: not `results/FILE.json` `PREFIX`: `KEY`, ...: {json_cell!r}"
    path = RESULTS / cell["file"]
    assert path.exists(), f"{where}: cites {path.relative_to(REPO)}, which is not there"
    data = json.loads(path.read_text())
    keys = _CODE.findall(cell["keys"])
    assert len(shown) == len(keys), f"{where}: {len(shown)} figures shown, {len(keys)} keys named"
    for key, (number, decimals, percent) in zip(keys, shown, strict=True):
        value = key_value(data, cell["prefix"] or "", key) * (100 if percent else 1)
        assert abs(value - number) <= 0.5 * 10**-decimals + 1e-9, f"{where}: {key} is {value}, the row shows {number}"
    return cell["file"]


def cpus_text(cpus: list[int]) -> str:
    """How a row writes a set of CPUs: ``CPU 0``, ``CPUs 1-15``, ``CPUs 0, 2``."""
    if len(cpus) == 1:
        return f"CPU {cpus[0]}"
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"CPUs {cpus[0]}-{cpus[-1]}"
    return "CPUs " + ", ".join(map(str, cpus))


def git_wrote(path: Path) -> tuple[str, str] | None:
    """The commit that last wrote ``path`` and its date, or None where the checkout has no such history."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h %ad", "--date=short", "--", str(path.relative_to(REPO))],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return (out[0], out[1]) if len(out) == 2 else None


def summary_rows() -> list[tuple[str, dict[str, str], list[str]]]:
    """Every row of RESULTS.md's tables: where it is, its cells by header, and the headers of its checked cells."""
    rows = []
    for header, body in tables(SUMMARY.read_text()):
        assert header[0] == "measured" and header[-1] == "JSON: keys", f"RESULTS.md: a table's header is {header}"
        assert {"command", "machine", "commit, date"} <= set(header), header
        checked = header[header.index("command") + 1 : header.index("machine")]
        for line, row in body:
            assert len(row) == len(header), f"RESULTS.md:{line}: {len(row)} cells, the header has {len(header)}"
            rows.append((f"RESULTS.md:{line}", dict(zip(header, row, strict=True)), checked))
    return rows


ROWS = summary_rows()


def test_the_summary_is_one_page_and_every_row_is_read() -> None:
    assert len(SUMMARY.read_text().splitlines()) <= MAX_LINES
    assert len(ROWS) >= 10, "the summary's tables were not found"


@pytest.mark.parametrize(("where", "row", "checked"), ROWS, ids=[where for where, _, _ in ROWS])
def test_each_figure_is_its_json_files(where: str, row: dict[str, str], checked: list[str]) -> None:
    shown = [number for header in checked for number in shown_numbers(row[header])]
    check_figures(f"{where}, the last cell", row["JSON: keys"], shown)


@pytest.mark.parametrize(("where", "row"), [(where, row) for where, row, _ in ROWS], ids=[w for w, _, _ in ROWS])
def test_each_row_names_its_runs_commit_date_and_machine(where: str, row: dict[str, str]) -> None:
    path = RESULTS / _JSON_CELL.match(row["JSON: keys"])["file"]
    run = json.loads(path.read_text()).get("run")
    stated = _COMMIT_CELL.match(row["commit, date"])
    assert stated, f"{where}: the commit cell is not `COMMIT` YYYY-MM-DD: {row['commit, date']!r}"
    if run is None:
        assert NO_RUN_RECORD in stated["note"], f"{where}: {path.name} has no run record and the row must say so"
        wrote = git_wrote(path)
        if wrote is None:
            pytest.skip(f"no git history of {path.name} in this checkout")
        assert (stated["commit"][:7], stated["date"]) == (wrote[0][:7], wrote[1]), f"{where}: git says {wrote}"
        return
    assert run["commit"].startswith(stated["commit"]), f"{where}: the run's commit is {run['commit']}"
    assert run["date"][:10] == stated["date"], f"{where}: the run's date is {run['date']}"
    machine = row["machine"]
    assert run["cpu_model"] in machine, f"{where}: the machine cell does not name {run['cpu_model']!r}"
    assert f"{run['cpus']} CPUs" in machine, f"{where}: the machine cell does not say {run['cpus']} CPUs"
    assert cpus_text(run["affinity"]) in machine, f"{where}: the benchmark ran on {cpus_text(run['affinity'])}"
    for pinned in run.get("pinned", []):
        assert cpus_text(pinned["cpus"]) in machine, f"{where}: {pinned['process']} ran on {cpus_text(pinned['cpus'])}"
    for gpu in run["gpus"]:
        assert gpu in machine, f"{where}: the machine cell does not name the GPU {gpu!r}"
    if not run["gpus"]:
        assert "no GPU" in machine, f"{where}: the machine had no GPU, and the row must say so"


def test_the_batch_names_are_defined_as_the_benchmarks_make_them() -> None:
    """RESULTS.md defines small, medium and large by their requests and query tokens, as testkit.batches makes them."""
    text = " ".join(SUMMARY.read_text().split())
    for name, batch in (("small", "small-8"), ("medium", "medium-64"), ("large", "large-256")):
        inputs = make_inputs(batch)
        requests, tokens = len(inputs.seq_lens), int(inputs.query_start_loc[-1])
        assert f"**{name}** ({batch}): {requests:,} requests, {tokens:,} query tokens" in text, name


def removed_files(replaced: bool = True) -> dict[str, str]:
    """history.md's table of the files removed from results/: name -> the commit it can be read at; with ``replaced``
    False, without those that a later run of the same name replaced."""
    row = re.compile(
        r"^\| `([\w.-]+\.json)` \| `git show ([0-9a-f]{7,40}):benchmarks/results/\1`[^|]*\| ([^|]*) \|$",
        re.M,
    )
    return {
        name: commit
        for name, commit, why in row.findall(HISTORY.read_text())
        if replaced or not why.startswith("replaced")
    }


def test_history_names_where_each_removed_file_is_and_cites_no_other() -> None:
    removed = removed_files()
    assert removed, "history.md's table of removed files was not found"
    still = [name for name in removed_files(replaced=False) if (RESULTS / name).exists()]
    assert not still, f"files listed as removed are still there: {still}"
    cited = set(re.findall(r"results/([\w.-]+\.(?:json|log))", HISTORY.read_text()))
    dangling = sorted(name for name in cited if not (RESULTS / name).exists() and name not in removed)
    # h200-rpc.json was removed before this table existed; its section says so.
    assert dangling == ["h200-rpc.json"], f"history.md cites results/ files neither there nor in its table: {dangling}"


def test_the_documents_cite_results_there_or_in_historys_table() -> None:
    """A JSON the documents name (`results/NAME.json`) is under results/, or history.md says where it can be read."""
    removed = removed_files()
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]
    dangling = [
        f"{document.relative_to(REPO)}: {name}"
        for document in documents
        for name in re.findall(r"results/([a-z0-9][\w.-]*\.json)", document.read_text())
        if not (RESULTS / name).exists() and name not in removed
    ]
    assert not dangling, "results cited that are neither in results/ nor in history.md's table:\n" + "\n".join(dangling)


def test_history_lists_every_file_kept_in_results() -> None:
    kept = set(re.findall(r"^\| `([\w.-]+)` \| [0-9a-f]{7,40}, \d{4}-\d\d-\d\d \|", HISTORY.read_text(), re.M))
    assert kept == {path.name for path in RESULTS.iterdir()}, "history.md's table of kept files is not results/"


def test_each_removed_file_can_be_read_at_its_commit() -> None:
    for name, commit in removed_files().items():
        try:
            found = subprocess.run(
                ["git", "cat-file", "-e", f"{commit}:benchmarks/results/{name}"], cwd=REPO, capture_output=True
            )
        except OSError:
            pytest.skip("no git here")
        if found.returncode and subprocess.run(["git", "cat-file", "-e", commit], cwd=REPO).returncode:
            pytest.skip(f"this checkout has no commit {commit} (a shallow clone)")
        assert found.returncode == 0, f"git show {commit}:benchmarks/results/{name} finds nothing"


def test_the_run_record_names_where_each_process_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """What every benchmark writes beside its figures: commit, date, host, CPU model, the CPUs of the benchmark and
    of each pinned process, GPUs and package versions."""
    monkeypatch.setattr(record_module, "_pinned", [])
    note_pinned(["/venv/bin/indexer-service", "serve", "--grpc-port", "0"], {0})
    note_pinned(["/usr/bin/python3", "-m", "benchmarks.bench_rpc", "--serve-echo", "/tmp/canned"], {0})
    record = run_record()
    assert {"commit", "date", "host", "cpu_model", "cpus", "affinity", "pinned", "gpus", "packages"} <= set(record)
    assert {"process": "indexer-service serve", "cpus": [0]} in record["pinned"]
    assert {"process": "python3 -m benchmarks.bench_rpc --serve-echo", "cpus": [0]} in record["pinned"]
    assert {"grpcio", "numpy", "torch", "triton"} <= set(record["packages"])
    assert process_name(["/bin/goecho", "-canned", "/tmp/x"]) == "goecho"


def test_the_run_record_names_the_cpus_the_service_pinned_its_workers_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_workers' replicas pin their workers themselves (``pin_workers on``), which the benchmark did not ask
    for: the record must name those CPUs, not say nothing was pinned."""
    cpus = cgroups.cpu_set()
    if len(cpus) < 2:
        pytest.skip(f"pin_workers needs a CPU per worker: this machine's CPU set is {cpus}")
    monkeypatch.setattr(record_module, "_pinned", [])
    with ServiceProcess(*FAST_START, "--workers", "2", "--pin-workers", "on"):
        pinned = run_record()["pinned"]
    assert sorted(pinned, key=lambda entry: entry["cpus"]) == [
        {"process": "indexer-service serve worker", "cpus": [cpus[0]]},
        {"process": "indexer-service serve worker", "cpus": [cpus[1]]},
    ]
