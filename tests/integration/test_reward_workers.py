"""A user reward function in worker processes (``tasks.reward_workers``): one that holds the
GIL past ``--reward-timeout`` is killed, replaced and counted as a reward error naming its
sample within seconds; one that ends its process is a reward error too; the workers ignore
SIGINT and SIGTERM and die with the trainer's process, whose signal handlers run at once while
a reward runs."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from rl_runs import ENV, REWARD, ROOT

from loggra_megatron.tasks.reward_workers import RewardWorkers
from loggra_megatron.tasks.rewards import load_reward_fn
from loggra_megatron.tasks.scoring import RewardFunctionError, Scoring


def _scoring(name: str, timeout: float, fraction: float, processes: int = 2) -> Scoring:
    spec = f"{REWARD}:{name}"
    workers = RewardWorkers(spec, processes, timeout)
    return Scoring(load_reward_fn(spec), None, 1.0, fraction, workers)


def test_a_reward_holding_the_gil_is_killed_at_its_timeout_and_counted():
    """A catastrophically backtracking regex ran on for 90 s under --reward-timeout 3 (a
    thread cannot stop it); its worker is killed after 2 s, the sample counted, and the next
    batch runs on a new worker."""
    scoring = _scoring("backtracks_on_b", timeout=2, fraction=0.5)
    start = time.perf_counter()
    scores = scoring.score(["a", "b", "a", "a"], ["c"] * 4, ["1"] * 4)
    assert time.perf_counter() - start < 10  # 2 s, and the workers' start
    (error,) = scores.errors
    assert error.index == 1 and scores.rewards == [0.5, 0.0, 0.5, 0.5]
    assert "did not return within --reward-timeout 2 s" in error.headline
    assert f"{REWARD}:backtracks_on_b" in error.headline and "(prompt: 'b')" in error.headline
    assert len(scoring.workers.alive) == 1  # the killed one is gone
    assert scoring.score(["a"] * 4, ["c"] * 4, ["1"] * 4).rewards == [0.5] * 4
    assert len(scoring.workers.alive) == 2
    strict = _scoring("backtracks_on_b", timeout=2, fraction=0.0)
    start = time.perf_counter()
    with pytest.raises(RewardFunctionError, match="did not return within --reward-timeout 2 s"):
        strict.score(["a", "b"], ["c"] * 2, ["1"] * 2)
    assert time.perf_counter() - start < 10
    scoring.workers.close()
    strict.workers.close()


def test_a_reward_that_ends_its_worker_process_is_a_reward_error():
    scoring = _scoring("ends_its_process", timeout=30, fraction=0.9)
    prompts = ["os._exit", "SIGKILL", "sys.exit", "KeyboardInterrupt", "fine"]
    scores = scoring.score(prompts, ["c"] * 5, ["1"] * 5)
    problems = [e.problem for e in scores.errors]
    assert problems == [
        "called os._exit(7)",
        "ended its worker process (signal SIGKILL)",
        "called sys.exit(3)",
        "raised",
    ]
    assert "KeyboardInterrupt" in scores.errors[3].traceback_text
    assert scores.rewards[4] == 1.0 and scores.correct == [False] * 4 + [True]
    scoring.workers.close()


TRAINER = """
import os, signal, sys, threading, time
from loggra_megatron.tasks.reward_workers import RewardWorkers
from loggra_megatron.tasks.rewards import load_reward_fn
from loggra_megatron.tasks.scoring import Scoring

spec = sys.argv[1]
caught = []
signal.signal(signal.SIGTERM, lambda *a: caught.append(time.perf_counter()))
scoring = Scoring(load_reward_fn(spec), None, 1.0, 0.5, RewardWorkers(spec, 2, 3.0))
scoring.score(["a"] * 2, ["c"] * 2, ["1"] * 2)  # the workers are up
pids = [w.process.pid for w in scoring.workers.alive]
for pid in pids:  # Ctrl-C and a scheduler's SIGTERM reach the workers too
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
sent = time.perf_counter() + 0.5
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
start = time.perf_counter()
scores = scoring.score(["b", "a", "a", "a"], ["c"] * 4, ["1"] * 4)
took = time.perf_counter() - start
print(len(scores.errors), round(caught[0] - sent, 2), round(took, 1), *pids, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit handler: the workers must die with it
"""


def test_the_trainers_handlers_run_while_a_reward_holds_the_gil_and_workers_die_with_it():
    """SIGTERM to the trainer while a worker runs the backtracking regex: its handler runs at
    once (the main thread only waits on the sockets), the call ends at --reward-timeout; the
    workers ignored SIGINT and SIGTERM, and are gone once the trainer is killed."""
    code = textwrap.dedent(TRAINER)
    proc = subprocess.run(
        [sys.executable, "-c", code, f"{REWARD}:backtracks_on_b"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    errors, handler_delay, took, *pids = proc.stdout.split()
    assert int(errors) == 1 and float(handler_delay) < 0.5 and 2.5 < float(took) < 8
    deadline = time.time() + 10
    while any(psutil.pid_exists(int(p)) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if psutil.pid_exists(int(p))]
    assert not alive or all(psutil.Process(int(p)).status() == "zombie" for p in alive)
    assert os.getpid()
