"""The tiers mean what they say: a unit test runs in the pytest process and starts no other
(no ranks, no torchrun, no subprocess; asking ``git`` which files it tracks is allowed); an
integration test starts at least one, ranks or a tool's process. A file that breaks the rule
belongs in the other folder."""

from __future__ import annotations

import ast
import os

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTERS = {"run_distributed", "torchrun", "Popen"}
"""Functions that start ranks or a process; and any function of these modules:"""
STARTER_MODULES = {"subprocess", "multiprocessing", "warm_launch"}


def _test_files(tier: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(folder, f), TESTS)
        for folder, _, files in os.walk(os.path.join(TESTS, tier))
        for f in files
        if f.startswith("test_") and f.endswith(".py")
    )


def _starts_a_process(name: str) -> bool:
    """Whether the file calls a starter (strings and comments that name one do not count)."""
    with open(os.path.join(TESTS, name)) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in STARTERS:
            return True
        if isinstance(func, ast.Attribute) and (
            func.attr in STARTERS
            or (isinstance(func.value, ast.Name) and func.value.id in STARTER_MODULES)
        ):
            return not _asks_git(node)
    return False


def _asks_git(call: ast.Call) -> bool:
    """``subprocess.run(["git", ...])``: a question to git, not a process of the project."""
    command = call.args[0] if call.args else None
    return (
        isinstance(command, ast.List)
        and bool(command.elts)
        and isinstance(command.elts[0], ast.Constant)
        and command.elts[0].value == "git"
    )


@pytest.mark.parametrize("name", _test_files("unit"))
def test_unit_tests_start_no_process(name):
    assert not _starts_a_process(name), f"{name} starts ranks or a process: tests/integration/"


@pytest.mark.parametrize("name", _test_files("integration"))
def test_integration_tests_start_a_process(name):
    assert _starts_a_process(name), f"{name} starts no rank or process: tests/unit/"
