"""The docs stay true: their runnable snippets run, their links resolve, the README's test command
is the one CI runs, and docs/design.md indexes every ``Note [...]`` of the code.

A snippet is runnable when the line before its fenced Python block is the HTML comment
``<!-- runnable -->`` (invisible on GitHub). It is a whole program: it is written to a file and
run in a fresh interpreter, and a multi-rank one starts its ranks itself through
``sharded_opt.spawn`` under ``if __name__ == "__main__":``. Other blocks (fragments, torchrun
across nodes) are illustrations and are not run.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE_MARK = "<!-- runnable -->"
_RUNNABLE_BLOCK = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_NOTE_DEFINITION = re.compile(r"^\s*(?:# )?Note \[([^\]]+)\]\s*$", re.MULTILINE)
_NOTE_ROW = re.compile(r"^\| \[([^\]]+)\] \| `([^`]+)` \|", re.MULTILINE)
SNIPPET_TIMEOUT_S = 120


def _relative(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def runnable_snippets() -> list[tuple[str, str]]:
    """(``file:line``, code) of every runnable block in the README and docs/."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in _RUNNABLE_BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{_relative(path)}:{line}", match.group(1)))
    return found


SNIPPETS = runnable_snippets()


def test_every_runnable_mark_opens_a_python_block() -> None:
    marks = sum(path.read_text().splitlines().count(RUNNABLE_MARK) for path in DOCS)
    assert marks == len(SNIPPETS) >= 4


@pytest.mark.parametrize("code", [code for _, code in SNIPPETS], ids=[name for name, _ in SNIPPETS])
def test_runnable_snippet_runs(code: str, tmp_path: pathlib.Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of the headings of a markdown page."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", DOCS, ids=_relative)
def test_links_resolve(page: pathlib.Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        assert path.exists(), f"{_relative(page)} links to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"{_relative(page)} links to {target}: no such heading"


def test_readme_test_command_is_the_one_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.endswith("&& .venv/bin/python -m pytest"))
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_design_page_indexes_every_note() -> None:
    defined = {
        (name, _relative(path))
        for package in ("sharded_opt", "fusion")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _NOTE_DEFINITION.findall(path.read_text())
    }
    indexed = set(_NOTE_ROW.findall((ROOT / "docs" / "design.md").read_text()))
    assert indexed == defined, (
        f"missing from docs/design.md: {sorted(defined - indexed)}; "
        f"indexed but not defined there: {sorted(indexed - defined)}"
    )


def test_performance_page_lists_every_results_file() -> None:
    """Each dated results write-up is summarized in one row of docs/performance.md's table."""
    listed = (ROOT / "docs" / "performance.md").read_text()
    missing = [
        path.name
        for path in sorted((ROOT / "benchmarks" / "results").glob("*.md"))
        if f"`{path.name}`" not in listed
    ]
    assert not missing, f"add a row for each to docs/performance.md's results table: {missing}"
