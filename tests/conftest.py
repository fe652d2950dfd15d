"""Shared fixtures: a sentencepiece tokenizer trained once per session on built-in tasks."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
