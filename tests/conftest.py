"""Shared fixtures (a sentencepiece tokenizer trained once per session on built-in tasks), and
the shared builders of ``tests/helpers`` on the import path of every test and of the
processes the tests start (spawned ranks inherit it)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "train_tokenizer.py"),
            "--builtin-tasks",
            "3000",
            "--vocab-size",
            "192",
            "--output-prefix",
            str(prefix),
        ],
        check=True,
        capture_output=True,
    )
    return f"{prefix}.model"
