"""CI runs on the newest Megatron-Core line the test files chosen by the Megatron-Core lines
they reach (``tools/select_megatron_tests.py``, its record ``tests/megatron_lines.json``);
these checks keep the record fresh: it knows every file holding megatron-marked tests, its
selection exists, and a changed version-sensitive input (the pin, a module that tells
releases apart) makes CI run every megatron-marked test."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = importlib.util.spec_from_file_location(
    "select_megatron_tests", os.path.join(ROOT, "tools", "select_megatron_tests.py")
)
select = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(select)
MARKED = re.compile(r"^(pytestmark = .*|\s*@)pytest\.mark\.megatron\b", re.MULTILINE)
"""A module-level mark or a decorator (not a mention in a string, as the marks rule has)."""


def _record() -> dict:
    with open(select.RECORD) as f:
        return json.load(f)


def _files_with_marked_tests() -> set[str]:
    found = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            path = os.path.join(folder, name)
            if name.startswith("test_") and name.endswith(".py"):
                with open(path) as f:
                    if MARKED.search(f.read()):
                        found.add(os.path.relpath(path, ROOT))
    return found


def test_the_record_knows_every_file_with_megatron_marked_tests():
    unknown = sorted(_files_with_marked_tests() - set(_record()["files"]))
    assert not unknown, (
        f"{unknown} hold megatron-marked tests the selection has not measured: run "
        "`.ci-venv312/bin/python tools/select_megatron_tests.py --measure`, or add each to "
        "tests/megatron_lines.json's `selected` and `files` by hand (selected: it then runs)"
    )


def test_every_selected_file_and_test_exists_and_the_selection_is_smaller():
    record = _record()
    measured = set(record["files"]) | set(record.get("tests", {}))
    assert record["selected"] and set(record["selected"]) <= measured
    for name in record["selected"]:
        path, _, test = name.partition("::")
        assert os.path.exists(os.path.join(ROOT, path)), name
        if test:  # a test id: its function is in the file
            with open(os.path.join(ROOT, path)) as f:
                assert f"def {test.split('[')[0]}(" in f.read(), name
    files = {name.split("::")[0] for name in record["selected"]}
    assert len(files) < len(record["files"])


def test_the_release_dependent_tests_exist():
    for name in select.RELEASE_DEPENDENT:
        path, _, test = name.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            assert f"def {test.split('[')[0]}(" in f.read(), name


def test_a_file_picked_for_few_lines_runs_only_the_tests_that_reach_them(monkeypatch, tmp_path):
    """``a`` reaches most lines; ``b`` adds one line (below ``SPLIT_BELOW``), which only its
    quick test ``b::t1`` reaches: CI runs ``a`` and ``b::t1``. ``c``'s measurement failed,
    and so did one of its tests: that test runs, its passing sibling (no new line) does not.
    ``d`` adds one line too, which both of its tests need between them: it runs whole, as
    does ``f``, whose one test reaching its line runs beside its other, failed, one."""
    lines = {
        "a": (range(0, 100), 10),
        "b": (range(50, 101), 50),
        "b::t1": ([100], 2),
        "b::t2": (range(50, 100), 48),
        "c": ([], 5),
        "c::t1": ([], 1),
        "c::t2": ([0], 1),
        "d": ([101, 102], 5),
        "d::t1": ([101], 2),
        "d::t2": ([102], 2),
        "f": ([103], 5),
        "f::t1": ([103], 2),
        "f::t2": ([], 1),
    }
    failed = {"c", "c::t1", "f::t2"}

    def measured(target, cache):
        found, seconds = lines[target]
        return {"seconds": seconds, "exit": int(target in failed), "lines": [*found]}

    monkeypatch.setattr(select, "_measured", measured)
    monkeypatch.setattr(select, "version", lambda name: "0.19.2")
    monkeypatch.setattr(
        select,
        "marked_tests",
        lambda *paths: [t for t in lines if t.partition("::")[0] in paths and "::" in t],
    )
    record = select.measure(str(tmp_path), ["a", "b", "c", "d", "f"])
    assert record["selected"] == ["a", "b::t1", "c::t1", "d", "f"]
    assert set(record["tests"]) == {
        "b::t1",
        "b::t2",
        "c::t1",
        "c::t2",
        "d::t1",
        "d::t2",
        "f::t1",
        "f::t2",
    }
    assert record["lines"] == 104 and record["files"]["b"]["lines"] == 51
    assert "adds" not in record["files"]["b"] and "adds" not in record["tests"]["b::t2"]
    assert record["files"]["d"]["adds"] == 2


def test_a_changed_version_sensitive_input_runs_every_megatron_test(monkeypatch):
    record = {**_record(), "inputs_sha256": select.inputs_digest()}
    planned = [*record["selected"], *select.RELEASE_DEPENDENT]
    assert select.plan(record) == ["-m", select.MARK, *planned]
    for path in select.VERSION_SENSITIVE:
        assert os.path.exists(os.path.join(ROOT, path)), path
    monkeypatch.setattr(select, "inputs_digest", lambda: "changed")
    assert select.plan(record) == ["-m", select.MARK, "tests"]


@pytest.mark.parametrize(
    ("lines", "seconds", "chosen"),
    [
        ({"a": {1, 2}, "b": {2, 3}, "c": {1, 2, 3}}, {"a": 1, "b": 1, "c": 1}, {"c": 3}),
        ({"a": {1, 2}, "b": {2, 3}, "c": {1, 2, 3}}, {"a": 1, "b": 1, "c": 9}, {"a": 2, "b": 1}),
        # "a" first (most lines per second), then "b" and "c" for 3 and 4: "a" is redundant
        (
            {"a": {1, 2}, "b": {1, 3}, "c": {2, 4}},
            {"a": 1, "b": 2, "c": 2},
            {"b": 2, "c": 2},
        ),
    ],
    ids=["most-lines", "most-lines-per-second", "a-redundant-early-pick-is-dropped"],
)
def test_the_greedy_cover_reaches_every_line(lines, seconds, chosen):
    assert select.greedy_cover(lines, seconds) == chosen


def test_a_pick_that_adds_few_lines_once_cheaper_tests_come_first_is_split_too(
    monkeypatch, tmp_path
):
    """``e`` adds 4 lines in the files' cover, 1 once ``b``'s quick test reaches three of
    them: it is split in a second round, and its test for that line runs instead."""
    lines = {
        "a": (range(0, 100), 10),
        "b": ([100, 200, 201, 202], 100),
        "b::t1": ([100, 200, 201, 202], 2),
        "b::t2": ([], 98),
        "e": ([200, 201, 202, 203], 4),
        "e::t1": ([203], 1),
        "e::t2": ([200, 201, 202], 3),
    }
    monkeypatch.setattr(
        select,
        "_measured",
        lambda target, cache: {
            "seconds": lines[target][1],
            "exit": 0,
            "lines": [*lines[target][0]],
        },
    )
    monkeypatch.setattr(select, "version", lambda name: "0.19.2")
    monkeypatch.setattr(select, "SPLIT_BELOW", 3)
    monkeypatch.setattr(
        select,
        "marked_tests",
        lambda *paths: [t for t in lines if t.partition("::")[0] in paths and "::" in t],
    )
    record = select.measure(str(tmp_path), ["a", "b", "e"])
    assert record["selected"] == ["a", "b::t1", "e::t1"]
