"""Every entry point's ``--help`` exits 0 (the first command a Megatron user types), and the
generated help escapes ``%`` once, centrally."""

import argparse
import dataclasses
import glob
import os
import subprocess
import sys
from pathlib import Path

from loggra_megatron.config import add_flags

ROOT = str(Path(__file__).resolve().parents[2])


def _scripts(folder: str) -> list[str]:
    """The scripts of ``folder`` (a module the others import, without ``__main__``, is not
    one)."""
    paths = glob.glob(os.path.join(ROOT, folder, "*.py"))
    return [os.path.relpath(p, ROOT) for p in paths if '__name__ == "__main__"' in open(p).read()]


ENTRY_POINTS = sorted(["pretrain_rl.py", *_scripts("tools"), *_scripts("benchmarks")])


def test_every_entry_point_prints_its_help():
    assert len(ENTRY_POINTS) >= 14, ENTRY_POINTS
    procs = {
        path: subprocess.Popen(
            [sys.executable, os.path.join(ROOT, path), "--help"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in ENTRY_POINTS
    }
    failures = {}
    for path, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failures[path] = (proc.returncode, err.strip().splitlines()[-1:] or out[-200:])
    assert not failures, failures


@dataclasses.dataclass
class _PercentSettings:
    """Settings whose docs hold 5 % and 100%."""

    budget: float = 0.05
    """Keep the controller under 5 % of a step (100%: off); %(default)s stays literal."""
    share: str = "10%"
    """A default that is itself a percentage."""


def test_generated_help_escapes_percent_once():
    parser = argparse.ArgumentParser(prog="x")
    add_flags(parser, {"percent": _PercentSettings})
    text = " ".join(parser.format_help().split())  # unwrapped
    assert "under 5 % of a step (100%: off)" in text
    assert "%(default)s stays literal" in text
    assert "(default: 10%)" in text
    assert "docs hold 5 % and 100%." in text
