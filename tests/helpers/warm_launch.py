"""Scripts of this repository run as ``python script ...`` or ``torchrun --nproc-per-node N
script ...`` would run them, but forked from the test harness's forkserver, which has imported
torch, Megatron-Core and the trainer once per session (``loggra_megatron.testing``), instead
of a fresh interpreter per process: a tiny run's ranks otherwise spend most of their CPU time
importing.

Each process is a real process running the real script as ``__main__`` (``sys.argv``, its own
environment, working directory, stdout and stderr; its exit code, or minus the signal that
ended it). Interpreter exit is kept: non-daemon threads are joined, then ``atexit`` runs.
``torchrun`` is followed where the scripts can tell: every rank gets its ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and one
intra-op thread, all ranks write to the same stdout and stderr, and when a rank fails the
others get SIGTERM, then SIGKILL after ``TERM_GRACE_S``, and the launch exits 1. ``run``
waits for the end; ``Launch`` hands back a running launch, for the tests that signal or kill
one of its ranks part way (each rank's pid, the output line by line as it comes).

What it cannot reproduce, and the tests that need it launch real processes instead: the
warnings a library prints while it is imported (imported once, in the server), a package tree
other than this one (``package_copy``), and the launcher's own behaviour (its messages, agent
restarts, signals sent to it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from loggra_megatron.testing import forkserver_context, rank_environment, rendezvous_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TERM_GRACE_S = 30.0
"""Seconds the other ranks get between SIGTERM and SIGKILL after one failed (torchrun's)."""


def run(
    script: str,
    argv: list[str],
    *,
    nproc: int | None = None,
    env: dict | None = None,
    cwd: str = ROOT,
    timeout: float = 600.0,
) -> subprocess.CompletedProcess:
    """``python script argv`` (``nproc=None``) or ``torchrun --nproc-per-node nproc
    --standalone script argv``; the finished process, as ``subprocess.run(...,
    capture_output=True, text=True)`` gives it (``subprocess.TimeoutExpired`` past
    ``timeout``, after killing every process)."""
    with Launch(script, argv, nproc=nproc, env=env, cwd=cwd, timeout=timeout) as launch:
        code = launch.wait(timeout)
        return subprocess.CompletedProcess(launch.args, code, launch.output(), _read(launch.err))


class Launch:
    """A launch while it runs, as ``subprocess.Popen(..., stdout=PIPE, stderr=STDOUT)`` gives
    one (``merge_stderr=True``; otherwise stderr is kept apart, as ``run`` keeps it): its
    output line by line, each process's pid by rank, its exit code. As a context manager it
    kills what is left of it on exit and removes its output files.

    The launch is watched by a thread from its start, as torchrun watches its workers: once a
    rank fails the others are stopped (``_wait``), whether or not anyone reads its output."""

    def __init__(
        self, script, argv, *, nproc=None, env=None, cwd=ROOT, timeout=600.0, merge_stderr=False
    ):
        script = os.path.abspath(os.path.join(cwd, script))
        if not script.startswith(ROOT + os.sep):
            raise ValueError(f"{script}: only this repository's scripts run warm")
        env = dict(os.environ if env is None else env)
        self._tmp = tempfile.TemporaryDirectory(prefix="warm_launch_")
        self.out = os.path.join(self._tmp.name, "stdout")
        self.err = self.out if merge_stderr else os.path.join(self._tmp.name, "stderr")
        open(self.out, "w").close()  # noqa: SIM115 (readable before a process writes)
        ctx = forkserver_context()
        ranks = _rank_envs(nproc) if nproc else [{}]
        self.args = [script, *map(str, argv)]
        self._procs = [
            ctx.Process(
                target=_main, args=(script, self.args[1:], {**env, **r}, cwd, self.out, self.err)
            )
            for r in ranks
        ]
        for p in self._procs:
            p.start()
        self._code: int | None = None
        self._stop = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, args=(timeout, nproc is not None), daemon=True
        )
        self._watcher.start()

    def _watch(self, timeout: float, torchrun: bool) -> None:
        try:
            self._code = _wait(self._procs, timeout, torchrun, self._stop)
        except subprocess.TimeoutExpired:
            for p in self._procs:
                _kill_group(p, signal.SIGKILL)

    def pid(self, rank: int = 0) -> int:
        """The process of ``rank`` (the one process without ``nproc``)."""
        return self._procs[rank].pid

    def lines(self):
        """The output, line by line as it is written, until every process has ended."""
        with open(self.out, errors="replace") as f:
            pending = ""
            while True:
                running = self._watcher.is_alive()
                pending += f.readline()
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
                elif not running:
                    rest = pending + f.read()
                    if rest:
                        yield rest
                    return
                else:
                    time.sleep(0.02)

    def first_line(self, predicate) -> str:
        """The first output line ``predicate`` holds for, once it is written
        (``AssertionError`` with the output if the launch ends without one)."""
        for line in self.lines():
            if predicate(line):
                return line
        raise AssertionError(f"exit {self._code} before the line awaited:\n{self.output()[-3000:]}")

    def wait(self, timeout: float) -> int:
        """The exit code (``subprocess.TimeoutExpired`` past ``timeout`` seconds, or past the
        launch's own timeout, after killing every process)."""
        self._watcher.join(timeout)
        late = self._watcher.is_alive()
        self.kill()
        if late or self._code is None:
            raise subprocess.TimeoutExpired(self.args, timeout, self.output())
        return self._code

    def output(self) -> str:
        """Everything written to stdout so far (and stderr, merged)."""
        return _read(self.out)

    def kill(self) -> None:
        """SIGKILL to every process group still running; returns once they have ended."""
        self._stop.set()
        self._watcher.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self._tmp.cleanup()


def _rank_envs(nproc: int) -> list[dict]:
    port = rendezvous_port()
    extra = {"GROUP_RANK": "0", "OMP_NUM_THREADS": "1"}
    return [{**rank_environment(r, nproc, port), **extra} for r in range(nproc)]


def _wait(procs, timeout: float, torchrun: bool, stop: threading.Event) -> int:
    """The launch's exit code: the one process's, or torchrun's (0, or 1 once a rank failed,
    the others stopped as torchrun stops them). Once ``stop`` is set, every process gets
    SIGKILL. Only this function polls the processes (a second poller could take an exit
    status from it)."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.exitcode is None for p in procs):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("", timeout)
        if stop.is_set():
            for p in procs:
                _kill_group(p, signal.SIGKILL)
        if torchrun and failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
            for p in procs:
                _kill_group(p, signal.SIGTERM)
        if failed_at is not None and time.monotonic() > failed_at + TERM_GRACE_S:
            for p in procs:
                _kill_group(p, signal.SIGKILL)
        time.sleep(0.05)
    for p in procs:
        p.join()
    if not torchrun:
        return procs[0].exitcode
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _kill_group(p, sig) -> None:
    if p.exitcode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _main(script, argv, env, cwd, out, err) -> None:
    """One process: the script as ``__main__``, then the interpreter's exit."""
    os.setpgid(0, 0)  # its group: a stop reaches the children it starts
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    _python_warning_options(env.get("PYTHONWARNINGS", ""))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)


def _python_warning_options(value: str) -> None:
    """``PYTHONWARNINGS`` as the interpreter applies it at start-up (ahead of the filters
    the server's interpreter started with)."""
    for option in filter(None, value.split(",")):
        warnings._processoptions([option])  # noqa: SLF001 (the interpreter's own parser)


def _exit(code: int) -> None:
    """What the interpreter does at exit: join non-daemon threads, run ``atexit``, flush."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
