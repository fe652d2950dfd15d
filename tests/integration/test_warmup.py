"""The supervised warm-up trains at --sft-lr with an optimizer and policy of its own (dense
Adam by default, every weight with a gradient, also under the backward sketch), hands its
weights to the RL policy, and resumes from a checkpoint taken during it exactly; then RL runs
at its own schedule."""

import pytest
import torch
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
    phase = trainer.warmup.phase
    seen, step = [], phase.stepper.step

    def recording_step():
        seen.append({g["lr"] for g in phase.optimizer.param_groups})
        return step()

    phase.stepper.step = recording_step
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


WARMUP = {"loggra-sketch": None, "sft-iters": 4, "sft-lr": 0.01, "train-iters": 0}
"""The default mode (the backward sketch) in RL, a dense warm-up before it."""


def _weights(model):
    return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}


def _warmup_hands_over(rank, argv):
    from loggra_megatron.arguments import parse_args
    from loggra_megatron.train.preflight import preflight
    from loggra_megatron.train.trainer import RLTrainer

    cfg = parse_args(argv, world_size=2)
    trainer = RLTrainer(cfg, preflight(cfg)).setup()
    phase = trainer.warmup.phase
    frozen_in_rl = sorted(
        n for n, p in trainer.policy.module.named_parameters() if not p.requires_grad
    )
    dense_in_warmup = all(p.requires_grad for p in phase.policy.module.parameters())
    started_equal = all(
        torch.equal(a, b)
        for a, b in zip(
            _weights(phase.policy).values(), _weights(trainer.policy).values(), strict=True
        )
    )
    start = _weights(trainer.policy)
    trainer.train()
    warm, rl = _weights(phase.policy), _weights(trainer.policy)
    return {
        "frozen_in_rl": frozen_in_rl,
        "dense_in_warmup": dense_in_warmup,
        "sft_optimizer": type(phase.optimizer).__name__,
        "started_equal": started_equal,
        "handed_over": all(torch.equal(warm[n], rl[n]) for n in warm),
        "phase_freed": trainer.warmup.phase is None,
        "targets_trained": all(
            not torch.equal(rl[n], start[n]) for n in rl if "linear_qkv.weight" in n
        ),
        "rl": rl,
    }


def _interrupted_warmup(rank, argv, load_argv):
    """Two warm-up steps, a checkpoint, then a new trainer that loads it and finishes."""
    from loggra_megatron.arguments import parse_args
    from loggra_megatron.train.preflight import preflight
    from loggra_megatron.train.trainer import RLTrainer

    cfg = parse_args(argv, world_size=2)
    first = RLTrainer(cfg, preflight(cfg)).setup()
    first.warmup.run(lambda: first.warmup.step >= 2, lambda line: None)
    first.save()
    first.metrics.close()
    cfg = parse_args(load_argv, world_size=2)
    second = RLTrainer(cfg, preflight(cfg)).setup()
    assert second.warmup.step == 2 and second.warmup.phase is not None
    second.train()
    return _weights(second.policy)


def test_the_warmup_has_its_own_dense_optimizer_and_hands_its_weights_over(tokenizer, tmp_path):
    argv = tiny_argv(tokenizer, **WARMUP, **{"output-dir": tmp_path / "run"})
    for r in run_distributed(_warmup_hands_over, 2, argv):
        # RL: the backward sketch's targets are frozen for autograd; the warm-up: nothing is
        assert any("linear_qkv.weight" in n for n in r["frozen_in_rl"])
        assert r["dense_in_warmup"] and "LoGRA" not in r["sft_optimizer"]
        assert r["started_equal"] and r["handed_over"] and r["phase_freed"]
        assert r["targets_trained"]  # dense gradients of the targets in the warm-up


def test_a_warmup_resumed_from_its_checkpoint_equals_the_uninterrupted_one(tokenizer, tmp_path):
    straight = tiny_argv(tokenizer, **WARMUP, **{"output-dir": tmp_path / "straight"})
    (uninterrupted, _) = [r["rl"] for r in run_distributed(_warmup_hands_over, 2, straight)]
    save = tmp_path / "ckpt"
    argv = tiny_argv(tokenizer, **WARMUP, save=save)
    results = run_distributed(
        _interrupted_warmup, 2, argv, tiny_argv(tokenizer, **WARMUP, save=save, load=save)
    )
    for name, w in uninterrupted.items():
        assert torch.equal(results[0][name], w), name
