"""Choose the tests CI runs on the newest Megatron-Core line by the Megatron-Core lines they
reach.

    .ci-venv312/bin/python tools/select_megatron_tests.py --measure   # about an hour
    python tools/select_megatron_tests.py --plan                      # what .ci/run runs

``--measure`` runs every test file that holds tests marked ``megatron`` on its own, under
coverage.py restricted to ``megatron.core`` (every rank and subprocess measured: a
``sitecustomize`` on ``PYTHONPATH`` starts coverage in every Python process, the test
harness's forkserver and its forked ranks included), and keeps
the set of Megatron-Core lines each file reaches and its time. A greedy cover then picks
files until their union reaches every line the whole set reaches, taking first the file
that adds the most new lines per second, and drops the slowest picks the others make
redundant; a file whose measurement failed (its lines unknown) is selected too. The record, ``tests/megatron_lines.json``, holds
the Megatron-Core version measured, each file's lines and seconds, the selection, and the
SHA-256 of the version-sensitive inputs: the ``megatron-core`` pin in ``pyproject.toml`` and
the modules that handle the differences between Megatron-Core releases
(``VERSION_SENSITIVE``, ``docs/megatron_versions.md``).

``--plan`` prints the ``pytest`` arguments for the newest line, one a line: the selected files, or
``tests`` (every megatron-marked test) when a version-sensitive input changed since the
record was measured. ``tests/unit/test_megatron_selection.py`` keeps the record fresh: every
file with megatron-marked tests is in it, and every selected file exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "megatron_lines.json")
MARK = "megatron and not slow and not gpu"
VERSION_SENSITIVE = (
    "pyproject.toml",
    "loggra_megatron/megatron_version.py",
    "loggra_megatron/rollout/dynamic/mcore_engine.py",
    "loggra_megatron/optim/megatron/optimizer_state.py",
)
"""Inputs whose change makes CI run every megatron-marked test on the newest line: the pin
(in ``pyproject.toml``) and the modules that tell Megatron-Core releases apart."""
COVERAGE_RC = """\
[run]
core = sysmon
source_pkgs = megatron.core
parallel = true
patch = subprocess
concurrency = multiprocessing,thread
sigterm = true
"""


def inputs_digest() -> str:
    """SHA-256 over the version-sensitive inputs (``pyproject.toml``: its pin line only)."""
    digest = hashlib.sha256()
    for path in VERSION_SENSITIVE:
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
        if path == "pyproject.toml":
            data = b"".join(line for line in data.splitlines() if b"megatron-core" in line)
        digest.update(path.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


def marked_files() -> list[str]:
    """The test files that hold tests marked ``megatron`` (not slow, not gpu)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", MARK],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    return sorted({line.split("::")[0] for line in out.splitlines() if "::" in line})


def _settle(work: str, quiet_s: float = 3.0, limit_s: float = 60.0) -> None:
    """Wait until no new coverage data file appears in ``work`` for ``quiet_s``: processes
    that outlive pytest (the test harness's forkserver) write theirs when they exit."""
    deadline, last, seen = time.monotonic() + limit_s, time.monotonic(), set(os.listdir(work))
    while time.monotonic() < deadline and time.monotonic() - last < quiet_s:
        time.sleep(0.5)
        now = set(os.listdir(work))
        if now != seen:
            seen, last = now, time.monotonic()


def measure_file(path: str, work: str) -> tuple[set[str], float, int]:
    """The Megatron-Core lines ``path``'s megatron-marked tests reach (``file:line``), its
    seconds, and pytest's exit code."""
    import coverage

    rc = os.path.join(work, ".coveragerc")
    with open(rc, "w") as f:
        f.write(COVERAGE_RC)
    with open(os.path.join(work, "sitecustomize.py"), "w") as f:
        f.write("import coverage\n\ncoverage.process_startup()\n")
    data = os.path.join(work, path.replace("/", "_"))
    path_before = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "COVERAGE_FILE": data,
        "COVERAGE_RCFILE": rc,
        "COVERAGE_PROCESS_START": rc,  # every Python process started: ranks forked from
        "PYTHONPATH": os.pathsep.join(filter(None, [work, path_before])),  # a forkserver too
    }
    t0 = time.perf_counter()
    code = subprocess.run(
        [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-m", MARK, path],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    ).returncode
    seconds = time.perf_counter() - t0
    _settle(work)
    cov = coverage.Coverage(data_file=data, config_file=rc)
    cov.combine(data_paths=[work], keep=False)
    measured = cov.get_data()
    base = os.path.dirname(os.path.dirname(__import__("megatron.core").core.__file__))
    lines = {
        f"{os.path.relpath(name, base)}:{n}"
        for name in measured.measured_files()
        for n in measured.lines(name) or ()
    }
    return lines, seconds, code


def greedy_cover(lines: dict[str, set[str]], seconds: dict[str, float]) -> dict[str, int]:
    """Files whose lines together are all of ``lines``' lines, most new lines per second
    first, then the slowest dropped first while the others still reach every line (a file
    picked early can be made redundant by later picks): ``{file: lines it adds}`` in the
    order picked."""
    left = set().union(*lines.values())
    chosen: dict[str, int] = {}
    while left:
        name = max(
            (n for n in lines if n not in chosen),
            key=lambda n: len(left & lines[n]) / max(seconds[n], 1.0),
        )
        chosen[name] = len(left & lines[name])
        left -= lines[name]
    for name in sorted(chosen, key=lambda n: -seconds[n]):
        others = [lines[n] for n in chosen if n != name]
        if lines[name] <= set().union(*others):
            del chosen[name]
    covered: set[str] = set()
    for name in chosen:  # what each adds, in the order picked, among those kept
        chosen[name] = len(lines[name] - covered)
        covered |= lines[name]
    return chosen


def measure(cache: str) -> dict:
    """Every file's lines (kept in ``cache``, one JSON file each: a rerun measures only the
    files not there), the cover, and the record."""
    import megatron.core

    lines, files = {}, {}
    os.makedirs(cache, exist_ok=True)
    for path in marked_files():
        kept = os.path.join(cache, path.replace("/", "_") + ".json")
        if os.path.exists(kept):
            with open(kept) as f:
                entry = json.load(f)
        else:
            with tempfile.TemporaryDirectory() as work:
                found, seconds, code = measure_file(path, work)
            entry = {"seconds": round(seconds, 1), "exit": code, "lines": sorted(found)}
            if code == 0:
                with open(kept, "w") as f:
                    json.dump(entry, f)
        lines[path] = set(entry["lines"])
        files[path] = {
            "seconds": entry["seconds"],
            "exit": entry["exit"],
            "lines": len(lines[path]),
        }
        print(
            f"{path}: {len(lines[path])} lines, {entry['seconds']:.0f} s (exit {entry['exit']})",
            flush=True,
        )
    chosen = greedy_cover(lines, {n: f["seconds"] for n, f in files.items()})
    for name, new in chosen.items():
        files[name]["adds"] = new
    failed = {n for n, f in files.items() if f["exit"] != 0}  # lines unknown: run them
    return {
        "megatron_core": megatron.core.__version__.split("+")[0],  # no local build tag
        "measured": time.strftime("%Y-%m-%d"),
        "inputs_sha256": inputs_digest(),
        "lines": len(set().union(*lines.values())),
        "selected": sorted(set(chosen) | failed),
        "files": files,
    }


def plan(record: dict) -> list[str]:
    """``pytest`` arguments for the newest line (module docstring)."""
    if record["inputs_sha256"] != inputs_digest():
        return ["-m", MARK, "tests"]
    return ["-m", MARK, *record["selected"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--measure", action="store_true", help="measure and write the record")
    p.add_argument(
        "--cache",
        default=os.path.join(ROOT, "runs", "megatron_lines"),
        help="--measure keeps each file's lines here; a rerun measures only the files not there",
    )
    what.add_argument("--plan", action="store_true", help="print the pytest arguments, one a line")
    args = p.parse_args()
    if args.measure:
        record = measure(args.cache)
        with open(RECORD + ".tmp", "w") as f:
            json.dump(record, f, indent=0)
        os.replace(RECORD + ".tmp", RECORD)
        seconds = sum(record["files"][n]["seconds"] for n in record["selected"])
        print(
            f"{len(record['selected'])} of {len(record['files'])} files reach all "
            f"{record['lines']} lines of megatron-core {record['megatron_core']} "
            f"({seconds:.0f} s of {sum(f['seconds'] for f in record['files'].values()):.0f})"
        )
    else:
        with open(RECORD) as f:
            print("\n".join(plan(json.load(f))))


if __name__ == "__main__":
    main()
