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
redundant. A file picked for fewer than ``SPLIT_BELOW`` lines, or whose measurement failed, is
then measured test by test (each test on its own, as a file is), its tests take its place,
and the cover runs again: CI runs only those of its tests that reach a line no other pick
does. A test or file whose measurement failed (its lines unknown) is selected too. The
record, ``tests/megatron_lines.json``, holds the Megatron-Core version measured, each file's
(and each split file's tests') lines and seconds, the selection (files and test ids), and
the SHA-256 of the version-sensitive inputs: the ``megatron-core`` pin in ``pyproject.toml``
and the modules that handle the differences between Megatron-Core releases
(``VERSION_SENSITIVE``, ``docs/megatron_versions.md``).

``--within-selection`` measures only the files of the record's selection (which reach every
line the whole set reached when it was measured) and refines the selection among them: a
quicker re-measurement after code changes that add no Megatron-Core calls.

``--plan`` prints the ``pytest`` arguments for the newest line, one a line: the selection, or
``tests`` (every megatron-marked test) when a version-sensitive input changed since the
record was measured. ``tests/unit/test_megatron_selection.py`` keeps the record fresh: every
file with megatron-marked tests is in it, and every selected file and test exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

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
RELEASE_DEPENDENT = (
    # megatron-core 0.19 replaces torch.storage._load_from_bytes at import: a pickled tensor
    # storage names Megatron's loader there, which reaches no Megatron-Core line
    "tests/integration/test_checkpoint_safety.py::"
    "test_transformer_engine_extra_state_is_checked_before_te_unpickles_it",
)
"""Tests the newest line runs besides the selection: their outcome depends on what a
Megatron-Core release does (a function it replaces at import), not on the lines they reach."""
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


SPLIT_BELOW = 64
"""A file the cover picks for fewer new lines than this is measured again test by test."""


def marked_tests(*paths: str) -> list[str]:
    """The ids of the tests marked ``megatron`` (not slow, not gpu) under ``paths``."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", MARK, *paths],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


def marked_files() -> list[str]:
    """The test files that hold tests marked ``megatron`` (not slow, not gpu)."""
    return sorted({test.split("::")[0] for test in marked_tests()})


def _settle(work: str, quiet_s: float = 3.0, limit_s: float = 60.0) -> None:
    """Wait until no new coverage data file appears in ``work`` for ``quiet_s``: processes
    that outlive pytest (the test harness's forkserver) write theirs when they exit."""
    deadline, last, seen = time.monotonic() + limit_s, time.monotonic(), set(os.listdir(work))
    while time.monotonic() < deadline and time.monotonic() - last < quiet_s:
        time.sleep(0.5)
        now = set(os.listdir(work))
        if now != seen:
            seen, last = now, time.monotonic()


def measure_target(path: str, work: str) -> tuple[set[str], float, int]:
    """The Megatron-Core lines the megatron-marked tests of ``path`` (a file or a test id)
    reach (``file:line``), their seconds, and pytest's exit code."""
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


def _measured(target: str, cache: str) -> dict:
    """``{"seconds", "exit", "lines"}`` of ``target`` (a file or a test id), kept in
    ``cache`` (one JSON file each: a rerun measures only what is not there)."""
    kept = os.path.join(cache, re.sub(r"[^\w.-]", "_", target) + ".json")
    if os.path.exists(kept):
        with open(kept) as f:
            return json.load(f)
    with tempfile.TemporaryDirectory() as work:
        found, seconds, code = measure_target(target, work)
    entry = {"seconds": round(seconds, 1), "exit": code, "lines": sorted(found)}
    if code == 0:
        with open(kept, "w") as f:
            json.dump(entry, f)
    print(f"{target}: {len(found)} lines, {seconds:.0f} s (exit {code})", flush=True)
    return entry


def _cover(entries: dict[str, dict]) -> list[str]:
    """The cover of ``entries``' lines, with every entry whose measurement failed."""
    lines = {n: set(e["lines"]) for n, e in entries.items()}
    chosen = greedy_cover(lines, {n: e["seconds"] for n, e in entries.items()})
    for name, entry in entries.items():  # "adds": only a pick's, of this cover
        entry.pop("adds", None)
        if name in chosen:
            entry["adds"] = chosen[name]
    return [*chosen, *(n for n, e in entries.items() if e["exit"] != 0 and n not in chosen)]


def _split_cover(entries: dict[str, dict], cache: str) -> tuple[list[str], dict[str, dict]]:
    """The cover, with every file it picks for fewer than ``SPLIT_BELOW`` lines (or whose
    measurement failed) replaced by its tests, until no pick is such a file (a pick can
    add fewer lines once cheaper tests are picked before it); and the tests measured."""
    candidates, tests = dict(entries), {}
    while True:
        chosen = _cover(candidates)
        split = [
            n
            for n in chosen
            if n in entries and (entries[n]["exit"] or entries[n]["adds"] < SPLIT_BELOW)
        ]
        if not split:
            break
        for path in split:
            del candidates[path]
            entries[path].pop("adds", None)  # its tests' now
        for test in marked_tests(*split):
            tests[test] = candidates[test] = _measured(test, cache)
    for path in {t.split("::")[0] for t in tests}:  # a file whose tests are all chosen
        of_file = [t for t in tests if t.split("::")[0] == path]
        if set(of_file) <= set(chosen):
            chosen = [c for c in chosen if c not in of_file] + [path]
            entries[path]["adds"] = sum(tests[t].get("adds", 0) for t in of_file)
    return chosen, tests


def measure(cache: str, files: list[str]) -> dict:
    """Each of ``files`` measured (a low pick test by test), the cover, and the record."""
    os.makedirs(cache, exist_ok=True)
    entries = {path: _measured(path, cache) for path in files}
    chosen, tests = _split_cover(entries, cache)
    candidates = {**entries, **tests}

    def summary(entry: dict) -> dict:
        return {**entry, "lines": len(entry["lines"])}

    return {
        "megatron_core": version("megatron-core").split("+")[0],  # no local build tag
        "measured": time.strftime("%Y-%m-%d"),
        "inputs_sha256": inputs_digest(),
        "lines": len(set().union(*(set(e["lines"]) for e in candidates.values()))),
        "selected": sorted(chosen),
        "files": {p: summary(e) for p, e in entries.items()},
        "tests": {t: summary(e) for t, e in tests.items()},
    }


def plan(record: dict) -> list[str]:
    """``pytest`` arguments for the newest line (module docstring)."""
    if record["inputs_sha256"] != inputs_digest():
        return ["-m", MARK, "tests"]
    return ["-m", MARK, *record["selected"], *RELEASE_DEPENDENT]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--measure", action="store_true", help="measure and write the record")
    p.add_argument(
        "--cache",
        default=os.path.join(ROOT, "runs", "megatron_lines"),
        help="--measure keeps each file's lines here; a rerun measures only the files not there",
    )
    p.add_argument(
        "--within-selection",
        action="store_true",
        help="--measure the files of the record's selection only (module docstring)",
    )
    what.add_argument("--plan", action="store_true", help="print the pytest arguments, one a line")
    args = p.parse_args()
    if not args.measure:
        with open(RECORD) as f:
            print("\n".join(plan(json.load(f))))
        return
    with open(RECORD) as f:
        before = json.load(f)
    files = marked_files()
    if args.within_selection:
        files = sorted({name.split("::")[0] for name in before["selected"]})
    record = measure(args.cache, files)
    if args.within_selection:  # the files not measured keep their entries
        record["files"] = {**before["files"], **record["files"]}
    with open(RECORD + ".tmp", "w") as f:
        json.dump(record, f, indent=0)
    os.replace(RECORD + ".tmp", RECORD)
    timed = {**record["files"], **record["tests"]}
    print(
        f"{len(record['selected'])} files and tests of {len(files)} files reach all "
        f"{record['lines']} lines of megatron-core {record['megatron_core']} "
        f"({sum(timed[n]['seconds'] for n in record['selected']):.0f} s of "
        f"{sum(record['files'][n]['seconds'] for n in files):.0f})"
    )


if __name__ == "__main__":
    main()
