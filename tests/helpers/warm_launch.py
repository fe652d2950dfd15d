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
others get SIGTERM, then SIGKILL after ``TERM_GRACE_S``, and the launch exits 1.

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

from loggra_megatron.parallel import free_port
from loggra_megatron.testing import forkserver_context, rank_environment

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
    script = os.path.abspath(os.path.join(cwd, script))
    if not script.startswith(ROOT + os.sep):
        raise ValueError(f"{script}: only this repository's scripts run warm")
    env = dict(os.environ if env is None else env)
    ctx = forkserver_context()
    with tempfile.TemporaryDirectory(prefix="warm_launch_") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        ranks = _rank_envs(nproc) if nproc else [{}]
        procs = [
            ctx.Process(
                target=_main, args=(script, argv, {**env, **r}, cwd, out, err), daemon=False
            )
            for r in ranks
        ]
        for p in procs:
            p.start()
        try:
            code = _wait(procs, timeout, torchrun=nproc is not None)
        except subprocess.TimeoutExpired:
            for p in procs:
                _kill_group(p, signal.SIGKILL)
            raise subprocess.TimeoutExpired(
                [script, *argv], timeout, _read(out), _read(err)
            ) from None
        return subprocess.CompletedProcess([script, *argv], code, _read(out), _read(err))


def _rank_envs(nproc: int) -> list[dict]:
    port = free_port()
    extra = {"GROUP_RANK": "0", "OMP_NUM_THREADS": "1"}
    return [{**rank_environment(r, nproc, port), **extra} for r in range(nproc)]


def _wait(procs, timeout: float, torchrun: bool) -> int:
    """The launch's exit code: the one process's, or torchrun's (0, or 1 once a rank failed,
    the others stopped as torchrun stops them)."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.exitcode is None for p in procs):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("", timeout)
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
