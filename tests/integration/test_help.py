"""Every entry point's ``--help`` exits 0 (the first command a Megatron user types), and the
generated help escapes ``%`` once, centrally."""

import argparse
import dataclasses
import glob
import os
from pathlib import Path

import warm_launch

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
    failures = {}
    for path in ENTRY_POINTS:
        proc = warm_launch.run(path, ["--help"], timeout=300)
        if proc.returncode != 0 or "usage:" not in proc.stdout:
            failures[path] = (proc.returncode, proc.stderr.strip().splitlines()[-1:])
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
