"""House rules a reviewer would otherwise check by hand (docs/architecture.md): modules under
500 lines, functions under 80, plain comments, with no Sphinx roles (``:class:`` …) that no renderer runs, and
no references to tracker entries."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    *sorted((ROOT / "loggra_megatron").rglob("*.py")),
    *sorted((ROOT / "benchmarks").rglob("*.py")),
    *sorted((ROOT / "tools").rglob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
    ROOT / "pretrain_rl.py",
]
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt"}
ISSUE_REF = re.compile(r"\bissues?\s*#?\s*\d+|\b(?:PRs?|pull requests?)\s*#\d+", re.IGNORECASE)


def test_package_modules_stay_under_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "loggra_megatron").rglob("*.py")
        if (n := len(p.read_text().splitlines())) >= 500
    }
    assert not long, f"split these modules (500 lines or more): {long}"


def test_functions_stay_under_80_lines():
    """Every function of the package, the tools, the benchmarks and ``pretrain_rl.py`` (the
    tests' helpers and fixtures are exempt)."""
    long = {}
    for path in SOURCES:
        if ROOT / "tests" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n >= 80:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"split these functions (80 lines or more): {long}"


def test_no_sphinx_roles():
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if SPHINX_ROLE.search(line) and p.name != "test_code_style.py"
    ]
    assert not found, f"plain ``name`` instead of a Sphinx role: {found[:10]}"


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (the test tree has no packages), so two
    ``test_x.py`` in different folders break collection of the whole run, though each folder
    alone collects (``tests/unit`` is the fast tier)."""
    seen: dict[str, list[str]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"


def test_no_tracker_references():
    """Code, tests and docs say what the code does and what failed, not which tracker entry
    asked for it: a bare ``issue 12`` means nothing to a reader without the tracker. Every
    tracked text file (and extensionless script, e.g. ``.ci/run``), Dockerfiles included."""
    assert ISSUE_REF.search("# see issue 12") and ISSUE_REF.search("PR #7")
    assert not ISSUE_REF.search("CUDA graph #1, every rank issues the same collectives")
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [
        ROOT / name
        for name in listed
        if name != "tests/unit/test_code_style.py"
        and (
            (p := Path(name)).suffix in TEXT_SUFFIXES
            or p.name.startswith("Dockerfile")
            or (not p.suffix and not p.name.startswith("."))
        )
    ]
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in paths
        if p.is_file()
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if ISSUE_REF.search(line)
    ]
    assert not found, f"say what the code does, not which issue asked for it: {found}"
