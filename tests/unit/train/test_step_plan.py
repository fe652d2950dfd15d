"""The plan of an RL step (``train/step_plan.StepPlan``) is derived once from a run's settings
and read by both the trainer and the memory estimator: for a few command lines, every number
of the plan against a hand count, the estimator's step is that plan, and the trainer's
(its LR schedule's length, the captured-energy count) too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from launch_flags import CONFIG_27B, estimator_cli
from memory_plans import plan_of

from loggra_megatron.memory.run_step import modelled_step
from loggra_megatron.model.config import ModelConfig
from loggra_megatron.train.step_plan import StepPlan

SMALL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8"]
SMALL += ["--seq-length", "512", "--max-new-tokens", "128", "--bf16"]
GRPO = ["--prompts-per-step", "8", "--num-generations", "4", "--global-batch-size", "8"]
KL = ["--kl-target", "0.01", "--kl-probe-fraction", "0.25", "--kl-coef", "0.05"]


@pytest.fixture(scope="module")
def cli():
    return estimator_cli()


def test_the_numbers_of_a_step_by_hand():
    """32 rollouts (8 prompts × 4) over DP 2 = 16 per replica; global batch 8 = 4 rows per
    replica per update, 2 micro-batches of 2; 32 / 8 = 4 mini-batches × 2 PPO epochs = 8
    updates; probe ⌈0.25 · 4⌉ = 1 row and as many held-out rows (kl/realized every 4th)."""
    argv = [*SMALL, *GRPO, *KL, "--micro-batch-size", "2", "--ppo-epochs", "2"]
    _, p = plan_of([*argv, "--log-prob-micro-batch-size", "3"], world_size=2)
    assert (p.data_parallel_size, p.rollout_batch_size, p.rows_per_update) == (2, 16, 4)
    assert (p.micro_batch_size, p.num_microbatches, p.updates_per_rl_step) == (2, 2, 8)
    assert p.forward_micro_batch_size == 3
    assert p.log_prob_chunk_size == ModelConfig.log_prob_chunk_size  # --log-prob-chunk-size
    assert p.reference_model and not p.reference_offload
    assert (p.kl_trial_rows, p.kl_estimator) == (2, "full")
    assert p.loggra_rank == 256 // 8 and p.prompt_tokens == 512 - 128
    assert p.rollout_engine == "dynamic" and p.precision == "bf16"  # auto on a GPU, bf16
    # no held-out rows without kl/realized; no trials without --kl-target; forward
    # micro-batches of --micro-batch-size by default; the reference on the host
    _, p = plan_of([*argv, "--kl-realized-interval", "0"], world_size=2)
    assert p.kl_trial_rows == 1 and p.forward_micro_batch_size == 2
    _, p = plan_of([*SMALL, *GRPO, "--kl-coef", "0.05", "--reference-offload"], world_size=4)
    assert (p.rollout_batch_size, p.rows_per_update, p.num_microbatches) == (8, 2, 2)
    assert p.updates_per_rl_step == 4 and p.kl_trial_rows == 0
    assert p.reference_model and p.reference_offload
    _, p = plan_of([*SMALL, *GRPO, "--log-prob-chunk-size", "128", "--loggra-rank", "16"])
    assert not p.reference_model and p.log_prob_chunk_size == 128 and p.loggra_rank == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seq_length = 4


def test_where_pi_old_comes_from():
    """The static engine samples π_old (free); the dynamic engine's is the training forward's
    own when one update per RL step makes it on-policy, else a forward after the rollout;
    --tis-cap needs the trainer's π_old beside the engine's, from the same two sources."""
    one_update = ["--prompts-per-step", "2", "--num-generations", "4", "--global-batch-size"]
    cases = {
        ("static", "8", False): "rollout",
        ("static", "8", True): "training",
        ("static", "4", True): "recompute",
        ("dynamic", "8", False): "training",
        ("dynamic", "4", False): "recompute",
    }
    for (engine, batch, tis), source in cases.items():
        argv = [*SMALL, *one_update, batch, "--rollout-engine", engine]
        _, p = plan_of(argv + (["--tis-cap", "2"] if tis else []))
        assert p.old_log_probs == source, (engine, batch, tis)
        assert (p.updates_per_rl_step == 1) == (batch == "8")


def test_the_estimator_models_the_plan_of_its_flags(cli):
    argv = [*SMALL, *GRPO, *KL, "--vocab-size", "1000", "--world-size", "2"]
    _, cfg, est = cli.parse(argv)
    shape, p = modelled_step(cfg, est)
    assert p == StepPlan.of(cfg, cuda=True) == plan_of(argv[:-4], world_size=2)[1]
    assert (shape.hidden_size, shape.vocab_size) == (256, 1000)
    _, cfg, est = cli.parse(["--hf-config", CONFIG_27B, "--tensor-model-parallel-size", "8"])
    assert modelled_step(cfg, est)[1].loggra_rank == 5120 // 8  # the adopted architecture's


def test_the_trainer_reads_the_same_plan():
    """``RLTrainer.plan`` is the plan of its settings on this machine, and the LR schedule
    decays over the plan's updates per RL step × --train-iters (8 × 3 here)."""
    from loggra_megatron.train import build
    from loggra_megatron.train.trainer import RLTrainer

    argv = [*SMALL, *GRPO, "--ppo-epochs", "2", "--train-iters", "3"]
    cfg, p = plan_of(argv, world_size=1)
    trainer = RLTrainer(cfg, host=None)
    assert trainer.plan == StepPlan.of(cfg, cuda=torch.cuda.is_available())
    assert trainer.plan.updates_per_rl_step == p.updates_per_rl_step == 32 // 8 * 2
    weight = torch.nn.Parameter(torch.zeros(2))
    scheduler = build.lr_scheduler(cfg, trainer.plan, torch.optim.SGD([weight], lr=1.0))
    assert scheduler.lr_decay_steps == 8 * 3
