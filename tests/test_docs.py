"""The docs: runnable code blocks in the README and docs/ are run (```python test on any
machine, ```python gpu on a GPU; the blocks of one file share a namespace, in order), the
README's commands are the ones CI and the sample use, and the docs stay readable: tables whose
cells fit their limits, and no development history (that lives in git and CHANGELOG.md)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python (test|gpu)\n(.*?)^```", re.S | re.M)

#: Words that tell the project's history instead of what holds now.
HISTORY = re.compile(
    r"\bstops? [0-9]+|\bthis stop\b|\bearlier stops?\b|\bissue [0-9]+|\bitem [0-9]+\b"
    r"|(slow|fast|middling) turn|turn of the machine",
    re.I,
)
README_ROWS, README_CELL, DOCS_CELL = 8, 200, 300


def blocks(kind: str) -> list:
    found = []
    for path in FILES:
        chunks = [code for tag, code in BLOCK.findall(path.read_text()) if tag == kind]
        if chunks:
            found.append(pytest.param(chunks, id=path.relative_to(ROOT).as_posix()))
    return found


def run(chunks: list[str], name: str) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{name}"}
    for number, code in enumerate(chunks):
        exec(compile(code, f"<{name} block {number}>", "exec"), namespace)


@pytest.mark.parametrize("chunks", blocks("test"))
def test_cpu_blocks(chunks, request):
    run(chunks, request.node.callspec.id)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", blocks("gpu"))
def test_gpu_blocks(chunks, request):
    run(chunks, request.node.callspec.id)


def test_there_are_runnable_blocks():
    assert blocks("test") and blocks("gpu")
    assert "```python test" in (ROOT / "docs" / "getting-started.md").read_text()


def readme_command(title: str) -> str:
    """The one-line command in the README's indented block after the bold title ``title``."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(f"**{title}**") :].split("\n\n", 2)[1]
    assert block.startswith("    ") and "\n" not in block.strip(), block
    return block.strip()


def test_ci_runs_the_readmes_test_command_verbatim():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_command("Run the tests") in lines


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in ``text``: its rows (separator row left out), each a list of cells.
    A ``|`` inside backticks or escaped is part of its cell."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            rows.append(cells(line.strip()))
        elif rows:
            found.append([row for row in rows if not all(re.fullmatch(r":?-+:?", c) for c in row)])
            rows = []
    return found


def cells(line: str) -> list[str]:
    parts, current, quoted, escaped = [], [], False, False
    for char in line.strip("|"):
        if char == "|" and not quoted and not escaped:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
        quoted ^= char == "`" and not escaped
        escaped = char == "\\" and not escaped
    return [*parts, "".join(current).strip()]


def test_the_table_reader_reads_cells_as_markdown_does():
    text = "a\n\n| x | `a | b` |\n|---|:-:|\n| 1 \\| 2 | 3 |\n\n| y |\n"
    assert tables(text) == [[["x", "`a | b`"], ["1 \\| 2", "3"]], [["y"]]]


def section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_readme_headline_table_is_short():
    headline = tables(section((ROOT / "README.md").read_text(), "## Headline numbers"))
    assert len(headline) == 1, "one headline table"
    rows = headline[0][1:]  # below the header row
    assert 0 < len(rows) <= README_ROWS, f"{len(rows)} rows: at most {README_ROWS}, the rest in docs/benchmarks"
    long = [cell for row in headline[0] for cell in row if len(cell) > README_CELL]
    assert long == [], f"README headline cells over {README_CELL} characters: {long}"


def test_the_benchmarks_index_is_one_table_of_short_cells_each_row_linking_its_page():
    index = ROOT / "docs" / "benchmarks" / "README.md"
    text = index.read_text()
    results = tables(section(text, "## Current results"))
    assert len(results) == 1
    for row in results[0][1:]:
        pages = re.findall(r"\]\(([\w.-]+\.md)\)", row[0])
        assert pages and all((index.parent / page).is_file() for page in pages), row[0]


def test_every_benchmark_page_names_its_command_and_its_machine():
    for page in sorted((ROOT / "docs" / "benchmarks").glob("*.md")):
        if page.name != "README.md":
            lines = page.read_text().splitlines()
            assert any(line.startswith("Command") for line in lines), page.name
            assert any(line.startswith("Machine") for line in lines), page.name


def markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_table_cell_in_the_docs_is_longer_than_the_limit():
    long = [
        (path.relative_to(ROOT).as_posix(), len(cell), cell[:60])
        for path in markdown_files()
        for table in tables(path.read_text())
        for row in table
        for cell in row
        if len(cell) > DOCS_CELL
    ]
    assert long == [], f"table cells over {DOCS_CELL} characters (move the detail into prose): {long}"


def source_files() -> list[pathlib.Path]:
    code = [path for folder in ("jitcore", "replay", "samples", "benchmarks") for path in (ROOT / folder).rglob("*.py")]
    return [*markdown_files(), *sorted(code), *sorted(path for path in (ROOT / "csrc").iterdir() if path.is_file())]


def test_docs_and_code_state_the_present_without_development_history():
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{number}: {match.group(0)!r}"
        for path in source_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in HISTORY.finditer(line)
    ]
    assert found == [], "history words (say what holds now; history lives in git):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "stop 29's six runs",
        "as this stop measured",
        "Issue 14, item 2",
        "on a slow turn",
        "a middling turn",
        "on the turn of the machine",
        "built 2026-12-01, stop 23",
        "earlier stops",
    ],
)
def test_the_history_pattern_finds_what_it_is_for(line):
    assert HISTORY.search(line)


@pytest.mark.parametrize("line", ["a non-stop loop", "the stop event", "items 2", "turns 3", "return"])
def test_the_history_pattern_leaves_ordinary_words_alone(line):
    assert not HISTORY.search(line)
