"""House rules a reviewer would otherwise check by hand (docs/architecture.md): modules under
500 lines, and plain comments, with no Sphinx roles (``:class:`` …) that no renderer runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    *sorted((ROOT / "loggra_megatron").rglob("*.py")),
    *sorted((ROOT / "benchmarks").rglob("*.py")),
    *sorted((ROOT / "tools").rglob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
    ROOT / "pretrain_rl.py",
]
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`")


def test_package_modules_stay_under_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "loggra_megatron").rglob("*.py")
        if (n := len(p.read_text().splitlines())) >= 500
    }
    assert not long, f"split these modules (500 lines or more): {long}"


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
