"""CI runs the tests marked ``megatron`` on the newest megatron-core too (``.ci/run``); these
checks keep that mark and the tested-version bookkeeping honest."""

from __future__ import annotations

import ast
import os
import re

import pytest

from loggra_megatron.megatron_version import TESTED, untested_version_note

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(TESTS)
# calls and imports that start Megatron-Core (ranks, a training process, a model)
USES_MEGATRON = re.compile(
    r"\b(run_distributed|torchrun|tiny_gpt_model|tiny_bf16_gpt_model)\(|^\s*(from|import) megatron\b",
    re.MULTILINE,
)


def _marked(source: str) -> bool:
    for node in ast.parse(source).body:
        targets = getattr(node, "targets", [])
        if any(getattr(t, "id", None) == "pytestmark" for t in targets):
            return "megatron" in ast.unparse(node.value)
    return False


@pytest.mark.parametrize(
    "name",
    sorted(
        os.path.relpath(os.path.join(folder, f), TESTS)
        for folder, _, files in os.walk(TESTS)
        for f in files
        if f.startswith("test_") and f.endswith(".py") and f != os.path.basename(__file__)
    ),
)
def test_modules_that_start_megatron_are_marked(name):
    with open(os.path.join(TESTS, name)) as f:
        source = f.read()
    if USES_MEGATRON.search(source):
        assert _marked(source), (
            f"{name} starts Megatron-Core: add pytestmark = pytest.mark.megatron"
        )


def test_the_guard_sees_what_it_should():
    assert USES_MEGATRON.search("    out = run_distributed(_worker, 2)\n")
    assert USES_MEGATRON.search("from megatron.core import parallel_state\n")
    assert not USES_MEGATRON.search('pattern = "torchrun --nproc-per-node 8 pretrain_rl.py"\n')
    assert _marked("import pytest\npytestmark = pytest.mark.megatron\n")
    assert not _marked("import pytest\npytestmark = pytest.mark.slow\n")


def test_tested_versions_are_the_dependency_bounds_docker_and_readme():
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    spec = next(r.specifier for r in deps if r.name == "megatron-core")
    assert {(s.operator, s.version) for s in spec} == {(">=", TESTED[0]), ("<=", TESTED[-1])}
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        assert f"ARG MEGATRON_CORE_VERSION={TESTED[-1]}\n" in f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        install = f.read().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert all(f"megatron-core {v}" in install for v in TESTED), install


def test_untested_version_warns_once_in_a_line():
    assert untested_version_note(TESTED[0]) is None and untested_version_note(TESTED[-1]) is None
    for version in ("0.15.3", "0.16.0", "0.20.0rc1", "1.0.0"):
        note = untested_version_note(version)
        assert note and "\n" not in note and version in note and TESTED[-1] in note
