"""Worker processes that run a user reward function (``--reward-fn module:function``).

A user reward function may never return, and it may hold the GIL while it runs (a regex that
backtracks catastrophically: ``re.match(r"(a+)+$", "a" * 40 + "b")``), which no thread of the
trainer's process can time out or even get a signal handler past. So ``RewardWorkers`` runs it
in ``--reward-workers`` processes per rank, each importing the function by its
``module:function`` path, the samples of a batch spread over them. Each call is bounded by
``--reward-timeout``: a worker still running then is killed (SIGKILL) and replaced, and the
sample is a reward error (``tasks.scoring``), as is a call that ends its worker process. The
trainer's main thread only waits on the workers' sockets, so SIGTERM and SIGINT run its
handlers at once (the agreed save at the next step boundary comes after at most
``--reward-timeout`` per call still running).

The workers are new interpreters (``subprocess``: a fork immediately followed by an exec), not
forks of the trainer: no CUDA context, process group or thread is inherited, so they are started
(at the first batch) and replaced at any point of the run. They start with SIGINT and SIGTERM
blocked, then ignore them (Ctrl-C on the terminal's process group, or a scheduler's SIGTERM to
every process of the job, is the trainer's to act on), and are killed when the trainer's process
ends (Linux ``PR_SET_PDEATHSIG``, and at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, Pipe, wait

from loggra_megatron.tasks.scoring import Outcome, RewardProblem, evaluate

START_TIMEOUT_S = 300.0
"""How long a new worker may take to start and import the reward function."""
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class RewardWorkerError(RuntimeError):
    """A worker process could not start the reward function."""


class RewardWorkers:
    """``processes`` worker processes running ``--reward-fn spec``, each call bounded by
    ``timeout`` seconds (0: no limit); started at the first ``run``."""

    def __init__(self, spec: str, processes: int, timeout: float):
        self.spec, self.processes, self.timeout = spec, processes, timeout
        self.idle: list[_Worker] = []
        self.alive: set[_Worker] = set()
        atexit.register(self.close)

    def run(self, samples: Sequence[tuple]) -> Iterator[tuple[int, Outcome | RewardProblem]]:
        """Each sample's outcome as it arrives: ``(index, (reward, verdict))``, or
        ``(index, RewardProblem)``. Closing the generator early kills the calls still running
        (their workers are replaced at the next call)."""
        if not self.alive:
            self.idle += self._start(min(self.processes, len(samples)))
        pending = list(reversed(range(len(samples))))
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        try:
            while pending or busy:
                while pending and len(busy) < self.processes:
                    i = pending.pop()
                    worker = self._send(samples[i])
                    deadline = time.monotonic() + self.timeout if self.timeout else math.inf
                    busy[worker.conn] = (worker, i, deadline)
                yield from self._collect(busy)
        finally:
            for worker, _, _ in busy.values():
                self._kill(worker)

    def close(self) -> None:
        """Kill every worker."""
        for worker in list(self.alive):
            self._kill(worker)

    def _collect(self, busy: dict) -> Iterator[tuple[int, Outcome | RewardProblem]]:
        """The replies that come before the nearest deadline, then the calls past theirs."""
        nearest = min(deadline for _, _, deadline in busy.values())
        left = None if nearest == math.inf else max(0.0, nearest - time.monotonic())
        for conn in wait(list(busy), timeout=left):
            worker, i, _ = busy.pop(conn)
            yield i, self._reply(worker)
        now = time.monotonic()
        for conn, (worker, i, deadline) in list(busy.items()):
            if now >= deadline:
                del busy[conn]
                self._kill(worker)
                yield (
                    i,
                    RewardProblem(
                        f"did not return within --reward-timeout {self.timeout:g} s (its worker "
                        "process was killed and is replaced)"
                    ),
                )

    def _reply(self, worker: _Worker) -> Outcome | RewardProblem:
        try:
            kind, *reply = worker.conn.recv()
        except (EOFError, OSError):
            return RewardProblem(f"ended its worker process ({self._kill(worker)})")
        self.idle.append(worker)
        return tuple(reply) if kind == "ok" else RewardProblem(*reply)

    def _send(self, args: tuple) -> _Worker:
        """An idle worker (or a new one, where none is) that was sent ``args``."""
        worker = self.idle.pop() if self.idle else self._start(1)[0]
        try:
            worker.conn.send(args)
        except OSError:  # it ended while idle (killed from outside): a new one takes it
            self._kill(worker)
            worker = self._start(1)[0]
            worker.conn.send(args)
        return worker

    def _start(self, count: int) -> list[_Worker]:
        """``count`` new workers, started together, each ready to take calls."""
        new = [_Worker(self.spec) for _ in range(max(1, count))]
        self.alive.update(new)
        for worker in new:
            problem = worker.wait_ready()
            if problem is not None:
                self.close()
                raise RewardWorkerError(f"--reward-fn {self.spec!r}: {problem}")
        return new

    def _kill(self, worker: _Worker) -> str:
        """Kill ``worker``; how its process ended."""
        self.alive.discard(worker)
        with contextlib.suppress(ValueError):
            self.idle.remove(worker)
        return worker.kill()


class _Worker:
    """One worker process and the trainer's end of its socket."""

    def __init__(self, spec: str):
        ours, theirs = Pipe(duplex=True)
        code = (
            f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r}); "
            "from loggra_megatron.tasks.reward_workers import serve; "
            f"serve({theirs.fileno()}, {os.getpid()})"
        )
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:  # the new process starts with them blocked (serve ignores, then unblocks them)
            self.process = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
        self.conn = ours
        ours.send((spec, sys.path))

    def wait_ready(self) -> str | None:
        """None once the worker has imported the function, else what went wrong."""
        if not self.conn.poll(START_TIMEOUT_S):
            return f"a worker process did not start within {START_TIMEOUT_S:g} s"
        try:
            kind, message = self.conn.recv()
        except (EOFError, OSError):
            return f"a worker process ended as it started ({self.kill()})"
        return None if kind == "ready" else f"a worker process could not load it: {message}"

    def kill(self) -> str:
        """Kill the process (if it still runs); how it ended."""
        self.process.kill()
        code = self.process.wait()
        self.conn.close()
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


# ------------------------------------------------------------------------- in the worker


def serve(fd: int, trainer: int) -> None:
    """A worker's loop: the spec and ``sys.path`` from the trainer, then one reply per call
    (``("ok", reward, verdict)`` or ``("error", problem, traceback)``) until the socket closes."""
    from loggra_megatron.tasks.rewards import RewardSpecError, load_reward_fn

    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with(trainer)
    conn = Connection(fd)
    spec, path = conn.recv()
    sys.path[:] = path
    try:
        fn = load_reward_fn(spec)
    except RewardSpecError as e:
        conn.send(("failed", str(e)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", *evaluate(fn, None, args)))
        except RewardProblem as problem:
            conn.send(("error", problem.problem, problem.traceback_text))


def _die_with(trainer: int) -> None:
    """SIGKILL this process when the trainer's ends (Linux), however it ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != trainer:  # it ended before that
        os._exit(0)
