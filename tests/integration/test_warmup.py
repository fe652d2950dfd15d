"""The supervised warm-up trains at --sft-lr, then RL runs at its own schedule."""

import pytest
from rl_runs import tiny_argv

from loggra_megatron.metrics import read_metrics
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def _warmup_lrs(rank, argv):
    from loggra_megatron.arguments import parse_args
    from loggra_megatron.train.preflight import preflight
    from loggra_megatron.train.trainer import RLTrainer

    cfg = parse_args(argv, world_size=2)
    trainer = RLTrainer(cfg, preflight(cfg)).setup()
    seen, step = [], trainer.warmup.stepper.step

    def recording_step():
        seen.append({g["lr"] for g in trainer.optimizer.param_groups})
        return step()

    trainer.warmup.stepper.step = recording_step
    trainer.train()
    return seen


def test_warmup_runs_at_sft_lr_and_rl_resumes_its_schedule(tokenizer, tmp_path):
    out = tmp_path / "run"
    argv = tiny_argv(
        tokenizer,
        **{"sft-iters": 3, "sft-lr": 0.05, "lr": 1e-4, "train-iters": 1, "output-dir": out},
    )
    for seen in run_distributed(_warmup_lrs, 2, argv):
        assert seen[:3] == [{0.05}] * 3  # every group, every warm-up step
    (row,) = read_metrics(out)
    assert row["lr"] == 1e-4
