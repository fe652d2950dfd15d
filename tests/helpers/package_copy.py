"""A copy of the package with a developer's change applied (new modules, registry lines), for
the recipe tests of docs/architecture.md: the change is made in-tree, as a developer makes it,
so an import cycle or a registry that a consumer does not follow fails there (registering at
run time, by ``monkeypatch``, would hide both)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_copy(tmp_path: Path, new_files: dict[str, str], edits: list[tuple]) -> Path:
    """``tmp_path/tree``: the package, ``pretrain_rl.py`` and ``tools/``, with ``new_files``
    (``{path in the tree: text}``) written and each ``(path, old, new)`` of ``edits`` made
    (``old`` must be there once)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "loggra_megatron", tree / "loggra_megatron")
    shutil.copytree(ROOT / "tools", tree / "tools")
    shutil.copy(ROOT / "pretrain_rl.py", tree / "pretrain_rl.py")
    for path, text in new_files.items():
        (tree / path).write_text(text)
    for path, old, new in edits:
        text = (tree / path).read_text()
        assert text.count(old) == 1, (path, old)
        (tree / path).write_text(text.replace(old, new))
    return tree


def run_in(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``python args...`` with the copy first on the import path, from a folder outside the
    repository (so nothing imports the original package)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=tree.parent
    )
