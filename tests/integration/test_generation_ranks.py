"""``pretrain_rl.py --generation-ranks``: generation on ranks of its own, end to end.

* Lock-step on 2 training ranks + 1 generation rank equals the colocated run on 2 ranks bit
  for bit (every metric, the trained weights), with the backward sketch, bf16 weights,
  predicted-KL control and a reference.
* A generation rank killed mid-run ends the run, non-zero, within 60 s, naming it.

Other layouts and the policy lag: ``test_generation_ranks_layouts.py``.
"""

import re
import signal

import pytest
import torch
from convert_cli import export_hf
from rl_runs import signal_rank_when, tiny_argv, torchrun

from loggra_megatron.metrics import read_metrics

pytestmark = pytest.mark.megatron

LOCKSTEP = {
    "loggra-sketch": None,  # the default: the backward sketch
    "train-iters": 3,
    "bf16": True,
    "kl-coef": 0.01,
    "kl-target": 0.002,  # below the predicted KL of every step: each is shrunk
}
PLACEMENT_KEYS = (
    "sync/",
    "time/training_idle_s",
    "time/generation_idle_s",
    "time/generation_hidden_fraction",
    "rollout/policy_lag",
)
VOLATILE = ("time/", "throughput/", "memory/peak")


@pytest.fixture(scope="module")
def lockstep(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    torchrun(tiny_argv(tokenizer, **LOCKSTEP, save=root / "colocated"))
    torchrun(
        tiny_argv(tokenizer, **LOCKSTEP, save=root / "split", **{"generation-ranks": 1}),
        nproc=3,
    )
    return root


def test_lockstep_generation_ranks_equal_the_colocated_run(lockstep, tmp_path):
    colocated, split = read_metrics(lockstep / "colocated"), read_metrics(lockstep / "split")
    assert len(colocated) == len(split) == 3
    for a, b in zip(colocated, split, strict=True):
        assert {k for k in b if not k.startswith(PLACEMENT_KEYS)} == set(a)
        for key in a:
            if not key.startswith(VOLATILE):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["sync/checksum_ok"] == 1.0 and b["sync/bytes"] > 0
        assert b["time/training_idle_s"] > 0 and b["time/generation_idle_s"] > 0
    assert any(r["kl/step_scale"] < 1 for r in colocated)  # KL control shrank a step
    ours, theirs = (export_hf(lockstep / n, tmp_path / n) for n in ("colocated", "split"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def _signal_generation_rank(tokenizer, tmp_path, signum) -> tuple[int, float, str]:
    """Signal the generation rank (global rank 2) once step 2 is printed: the exit status,
    the seconds from the signal to the end, and everything printed."""
    argv = tiny_argv(
        tokenizer, **{**LOCKSTEP, "train-iters": 200, "generation-ranks": 1}, save=tmp_path
    )
    return signal_rank_when(
        argv, lambda line: re.search(r"step +2/200", line), 2, signum, nproc=3, timeout=120
    )


def test_a_killed_generation_rank_ends_the_run_naming_it(tokenizer, tmp_path):
    status, elapsed, text = _signal_generation_rank(tokenizer, tmp_path, signal.SIGKILL)
    assert status != 0
    assert elapsed < 60, elapsed
    assert "generation" in text and "global rank 2" in text, text[-3000:]


def test_sigterm_on_a_generation_rank_is_the_agreed_save_and_exit(tokenizer, tmp_path):
    status, _, text = _signal_generation_rank(tokenizer, tmp_path, signal.SIGTERM)
    assert status == 0, text[-3000:]
    assert "SIGTERM on a generation rank" in text
    saved = int((tmp_path / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 200 and len(read_metrics(tmp_path)) == saved
