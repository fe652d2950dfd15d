"""Tiny ``pretrain_rl.py`` runs for the tests: the flags of a 2-layer policy, and torchrun."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import warm_launch

from loggra_megatron.optim.registry import OPTIMIZERS
from loggra_megatron.tasks import TASKS

ROOT = str(Path(__file__).resolve().parents[2])
REWARD = os.path.join(ROOT, "tests", "helpers", "reward_fns.py")
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}


def tiny_argv(tokenizer, **overrides) -> list[str]:
    """Flags of a tiny run; ``overrides`` by flag name (None/False drops a flag, True sets a
    switch). With a dense ``optimizer`` (adam) LoGRA's flags are left out (they would not
    apply); with LoGRA the mode is ``--loggra-sketch gradient`` unless ``loggra-sketch`` is
    given (``None``: the default mode, the backward sketch)."""
    flags = {
        "tokenizer-model": tokenizer,
        "num-layers": 2,
        "hidden-size": 64,
        "num-attention-heads": 4,
        "seq-length": 64,
        "max-new-tokens": 12,
        "prompts-per-step": 4,
        "num-generations": 4,
        "global-batch-size": 8,
        "micro-batch-size": 2,
        "train-iters": 2,
        "lr": 3e-3,
        "loggra-rank": 8,
        "loggra-min-dim": 16,
        "reward-fn": f"{REWARD}:digit_count",
        "seed": 7,
        "num-tasks": 512,  # of the built-in task: 10000 by default, ~1 s per rank to make
    }
    spec = OPTIMIZERS.get(overrides.get("optimizer", "loggra"))
    if spec is not None and not spec.sketched:
        del flags["loggra-rank"], flags["loggra-min-dim"]
    elif "loggra-sketch" not in overrides:
        flags["loggra-sketch"] = "gradient"  # named: these runs were written for it
    elif overrides["loggra-sketch"] != "gradient":
        del flags["loggra-min-dim"]  # the gradient sketch's only
    flags.update(overrides)
    task = flags.get("task") or ("jsonl" if flags.get("data-path") else "arithmetic")
    if TASKS[task].needs_data:  # the files give the examples: the flag would be refused
        del flags["num-tasks"]
    argv = []
    for key, value in flags.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not None and value is not False:
            argv += [f"--{key}", str(value)]
    return argv


def tiny_policy(argv: list[str]):
    """``(cfg, host, policy, examples)`` of a one-process run of ``argv`` on CPU: its
    settings, preflight, the policy as the trainer builds it and one RL step's prompts (call
    it inside a ``run_distributed`` worker)."""
    import torch

    from loggra_megatron.arguments import parse_args
    from loggra_megatron.train import build
    from loggra_megatron.train.preflight import preflight

    cfg = parse_args(argv, world_size=1)
    host = preflight(cfg)
    args = build.model_args(cfg, host.tokenizer)
    policy, _ = build.trainable_policy(cfg, args, torch.device("cpu"))
    examples = next(host.dataset.batches(cfg.grpo.prompts_per_step, dp_rank=0, dp_size=1))
    return cfg, host, policy, examples


def torchrun(argv, nproc=2, check=True, timeout=600, script="pretrain_rl.py", warm=True):
    """``torchrun --nproc-per-node nproc script argv`` (a path under the repository); the
    finished process. ``warm``: its ranks fork from the harness's forkserver, which imported
    the trainer once (``warm_launch``); ``warm=False``: torchrun itself, for what only a
    fresh launcher shows (import-time warnings, the launcher's own behaviour)."""
    if warm:
        proc = warm_launch.run(script, list(map(str, argv)), nproc=nproc, env=ENV, timeout=timeout)
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--standalone",
            os.path.join(ROOT, script),
            *argv,
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def signal_rank_when(
    argv, awaited, rank: int = 0, signum=signal.SIGTERM, nproc: int | None = 2, timeout=300
) -> tuple[int, float, str]:
    """``pretrain_rl.py argv`` on ``nproc`` ranks (None: one process, no torchrun), forked
    warm; once it prints a line ``awaited(line)`` holds for, ``signum`` to ``rank``. The exit
    code, the seconds from the signal to the end, and all it printed (stdout and stderr)."""
    with warm_launch.Launch(
        "pretrain_rl.py", argv, nproc=nproc, env=ENV, timeout=timeout, merge_stderr=True
    ) as launch:
        launch.first_line(awaited)
        os.kill(launch.pid(rank), signum)
        signalled = time.monotonic()
        code = launch.wait(timeout)
        return code, time.monotonic() - signalled, launch.output()


def refused(argv, capsys, *needles) -> str:
    """``parse_args(argv)`` at world size 2 exits 2 with every needle in its message; the
    message."""
    import pytest

    from loggra_megatron.arguments import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=2)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err
