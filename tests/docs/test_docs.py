"""The docs stay true: their runnable snippets run, their links resolve, the README's test command
is the one CI runs, docs/design.md indexes every ``Note [...]`` of the code with the tests that
exercise it, and the library's comments and docstrings give reasons, not timings: measured
numbers live in dated files under ``benchmarks/results/``, which the library links.

A snippet is runnable when the line before its fenced Python block is the HTML comment
``<!-- runnable -->`` (invisible on GitHub). It is a whole program: it is written to a file and
run in a fresh interpreter, and a multi-rank one starts its ranks itself through
``sharded_opt.spawn`` under ``if __name__ == "__main__":``. Other blocks (fragments, torchrun
across nodes) are illustrations and are not run.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE_MARK = "<!-- runnable -->"
_RUNNABLE_BLOCK = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_NOTE_DEFINITION = re.compile(r"^\s*(?:# )?Note \[([^\]]+)\]\s*$", re.MULTILINE)
_NOTE_ROW = re.compile(r"^\| \[([^\]]+)\] \| `([^`]+)` \|", re.MULTILINE)
_NOTE_ROW_CELLS = re.compile(r"^\| \[([^\]]+)\] \| `[^`]+` \| [^|]* \|(.*)\|$", re.MULTILINE)
_TESTED_BY_ENTRY = re.compile(r"^(tests/[\w/]+\.py)(?:::(\w+)(?:\[([\w.-]+)\])?)?$")
SNIPPET_TIMEOUT_S = 120
LIBRARY_PACKAGES = ("sharded_opt", "fusion")

_NUMBER = r"\d+(?:[.,]\d+)*"
_TIMING_FIGURE = re.compile(
    rf"~?{_NUMBER}(?:\s?(?:-|to|and)\s?~?{_NUMBER})?\s?"
    r"(?:(?:ns|us|µs|ms)\b"  # 0.6-0.9 ms, 3 µs
    r"|(?:nano|micro|milli)?seconds?\b"  # 3 microseconds, 2 seconds
    r"|s per\b"  # 1.2 s per step
    r"|[KMGT]i?B/s\b|[KMGT](?:bit|b/s)\b"  # 110 MB/s, 200 Mbit/s
    r"|%\s(?:faster|slower|longer|shorter|quicker)\b)"  # 2-9% faster
    r"|\d\.\d+x\b"  # 0.31x, ~1.5x: a measured ratio (sizes and constants are integers)
    rf"|{_NUMBER}x (?:faster|slower|the (?:wire |link )?limit)\b"  # 2x faster, 2x the limit
    rf"|\b(?:hid|hides|hidden|took|takes|spent)\s~?{_NUMBER}\s?%"  # hid 11 % of the communication
    r"|\b(?:twice|half|three times) as (?:fast|slow)\b"
    r"|\b(?:overlap|sync|DDP|ZeRO|plain|compute|comm)\s?/\s?\w+\s~?\d\.\d+",  # overlap/DDP 1.07
    re.IGNORECASE,
)
"""A timing figure: a duration, a rate, or how much faster something measured. Sizes ("16 MiB"),
counts and constants are not: they may stay next to the code they size."""

_OUTSIDE_PATH = re.compile(r"(?:/tmp/|/work/|/home/|\.\./shared|MACHINE_NOTES)")
"""A path outside the repository: the reader of the library cannot follow it."""

_RESULTS_FILE = re.compile(r"benchmarks/results/[\w.-]+\.md")


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


def _library_files() -> list[pathlib.Path]:
    return [path for package in LIBRARY_PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _prose(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and bare string statement (docstrings, attribute docstrings)
    of a Python file: the prose the library explains itself in, not its code or its messages."""
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.extend(
                (node.lineno + offset, line) for offset, line in enumerate(node.value.value.split("\n"))
            )
    return found


def timing_figures(path: pathlib.Path) -> list[str]:
    """``file:line: text`` of every timing figure in the comments and docstrings of ``path``. A
    figure broken over two lines is found in the pair."""
    hits = []
    prose = sorted(_prose(path))
    for index, (line, text) in enumerate(prose):
        following = prose[index + 1][1].strip() if index + 1 < len(prose) else ""
        for match in _TIMING_FIGURE.finditer(f"{text.rstrip()} {following}"):
            if match.start() < len(text.rstrip()):
                hits.append(f"{_relative(path)}:{line}: {text.strip()}")
                break
    return hits


@pytest.mark.parametrize(
    ("text", "is_figure"),
    [
        ("took 307-323 ms against 312-355 ms", True),
        ("take 0.6-0.9 ms each on the training thread", True),
        ("costs about 3 microseconds of Python", True),
        ("on a 200 Mbit/s link", True),
        ("each collective alone was 2-9% faster", True),
        ("2048 wide, 0.31x with 1 MiB chunks", True),
        ("its all-gather costs ~1.5x the limit", True),
        ("a compiled overlap hid 11 % of the communication", True),
        ("the all-gather is twice as fast", True),
        ("Timed out after 3 seconds waiting for clients", True),
        ("overlap/DDP 1.072 and 1.093 with the collectives", True),
        ("overlap/DDP at most the planner's pick; sync / DDP in the table", False),
        ("a 16 MiB budget of buckets at once", False),
        ("buckets between 64 KiB and 25 MiB", False),
        ("+4 bytes per fp32 param on every rank", False),
        ("a 2 x 2 grid of ranks; world_size * 2 bytes", False),
        ("wait at least 600 s to join", False),
        ("it put 13 % errors into the step", False),
        ("medians of 3 repeats, 8 buckets, 12/N of the state", False),
        ("the pieces of 0x10 params, 1e-4 off plain torch", False),
    ],
)
def test_timing_figure_pattern(text: str, is_figure: bool) -> None:
    assert bool(_TIMING_FIGURE.search(text)) == is_figure


@pytest.mark.parametrize(
    "path",
    _library_files(),
    ids=_relative,
)
def test_library_prose_gives_reasons_not_timings(path: pathlib.Path) -> None:
    """Timings go stale with every change and every machine; a Note says why and links the dated
    results file that has the numbers (``benchmarks/results/<date>-<name>.md``)."""
    figures = timing_figures(path)
    assert not figures, "move these figures into a results file and link it:\n" + "\n".join(figures)


def test_library_prose_cites_only_paths_in_the_repository() -> None:
    outside = [
        f"{_relative(path)}:{line}: {text.strip()}"
        for path in _library_files()
        for line, text in _prose(path)
        if _OUTSIDE_PATH.search(text)
    ]
    assert not outside, "\n".join(outside)


def test_results_files_the_library_cites_exist() -> None:
    cited = {name for path in _library_files() for name in _RESULTS_FILE.findall(path.read_text())}
    assert cited, "the library cites no results file: is the pattern out of date?"
    missing = sorted(name for name in cited if not (ROOT / name).is_file())
    assert not missing, f"cited by the library, not in the repository: {missing}"


def _tested_by_problem(note: str, entry: str) -> str | None:
    """Why ``entry`` of a "tested by" cell does not point at a test of ``note``, or None."""
    match = _TESTED_BY_ENTRY.match(entry)
    if match is None:
        return f"{entry!r} is not tests/...py, tests/...py::test or tests/...py::test[case]"
    path, test, case = match.groups()
    if not (ROOT / path).is_file():
        return f"{path} does not exist"
    text = (ROOT / path).read_text()
    if test is None:
        return None if f"[{note}]" in text else f"{path} does not name Note [{note}]: name a test in it"
    if not re.search(rf"^\s*(?:async )?def {test}\(", text, re.MULTILINE):
        return f"{path} defines no {test}"
    if case is not None and f'"{case}"' not in text and f"'{case}'" not in text:
        return f"{path} has no case {case!r}"
    return None


def test_design_page_names_the_tests_of_every_note() -> None:
    rows = _NOTE_ROW_CELLS.findall((ROOT / "docs" / "design.md").read_text())
    assert len(rows) == len(_NOTE_ROW.findall((ROOT / "docs" / "design.md").read_text()))
    problems = []
    for note, cell in rows:
        entries = re.findall(r"`([^`]+)`", cell)
        if not entries:
            problems.append(f"[{note}]: empty 'tested by' cell")
        problems.extend(
            f"[{note}]: {problem}" for entry in entries if (problem := _tested_by_problem(note, entry))
        )
    assert not problems, "\n".join(problems)


_PACKAGE_ROW = re.compile(r"^\| \*\*`([\w/]+)`\*\*(?: \(top\))? \| [^|]+ \| ([^|]*) \|$", re.MULTILINE)


def _package_of(module: str) -> str:
    """``fusion``, ``top`` (a module of ``sharded_opt`` itself) or the ``sharded_opt`` subpackage
    that holds ``module`` (a dotted path)."""
    parts = module.split(".")
    if parts[0] == "fusion":
        return "fusion"
    is_subpackage = (ROOT / "sharded_opt" / parts[1]).is_dir() if len(parts) > 1 else False
    return parts[1] if is_subpackage else "top"


def _allowed_imports() -> dict[str, set[str] | None]:
    """Per package, the packages the design page's layout table lets it import (None: any)."""
    text = (ROOT / "docs/design.md").read_text()
    layout = text[text.index("## Layout") : text.index("## The layout: params in flat buckets")]
    allowed: dict[str, set[str] | None] = {}
    for path, cell in _PACKAGE_ROW.findall(layout):
        package = path.strip("/").split("/")[-1]
        package = "top" if package == "sharded_opt" else package
        names = re.findall(r"`(\w+)`", cell)
        everything = cell.strip() == "everything above"
        allowed[package] = None if everything else {"top" if n == "sharded_opt" else n for n in names}
    return allowed


def _imported_modules(path: pathlib.Path) -> list[str]:
    """The library modules (dotted) that ``path`` imports from."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith(("sharded_opt", "fusion"))
        ):
            if node.module == "sharded_opt":  # ``from sharded_opt import x``: x a module or a name
                found += [f"sharded_opt.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
    return found


def test_packages_import_only_what_the_layout_allows() -> None:
    allowed = _allowed_imports()
    packages = {
        "fusion",
        "comm",
        "model_hooks",
        "guards",
        "step",
        "state",
        "launch",
        "top",
        "integrations",
        "plan",
    }
    assert set(allowed) == packages, sorted(allowed)
    wrong = []
    for path in sorted([*(ROOT / "sharded_opt").rglob("*.py"), *(ROOT / "fusion").rglob("*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        package, may_import = _package_of(module), allowed[_package_of(module)]
        for target in _imported_modules(path):
            other = _package_of(target)
            if other != package and may_import is not None and other not in may_import:
                wrong.append(f"{module} imports {target}: {package} may import {sorted(may_import)}")
    assert not wrong, "\n".join(wrong)
