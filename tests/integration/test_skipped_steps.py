"""Non-finite gradients: the step is skipped (weights, optimizer state and LR schedule
unchanged), counted in the metrics, and the run stops after too many in a row."""

import math

import pytest
import torch
from rl_runs import tiny_argv

from loggra_megatron.metrics import read_metrics
from loggra_megatron.testing import run_distributed, tiny_gpt_model, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def _params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _nan_loss_run(rank, argv):
    """The trainer with β = inf: the KL term is inf·0 = NaN, so every gradient is NaN."""
    from loggra_megatron.arguments import parse_args
    from loggra_megatron.train.preflight import preflight
    from loggra_megatron.train.trainer import RLTrainer, TrainingStopped

    cfg = parse_args(argv, world_size=2)
    trainer = RLTrainer(cfg, preflight(cfg)).setup()
    before, lr = _params(trainer.policy.module), trainer.optimizer.param_groups[0]["lr"]
    trainer.kl_coef.value = math.inf  # what --kl-coef inf did before it was refused at parse
    try:
        trainer.train()
        stopped = None
    except TrainingStopped as e:
        stopped = str(e)
    after = _params(trainer.policy.module)
    return {
        "stopped": stopped,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "scheduler_steps": trainer.scheduler.num_steps,
        "lr_unchanged": trainer.optimizer.param_groups[0]["lr"] == lr,
        "skipped_total": trainer.skips.total,
    }


@pytest.mark.parametrize(
    "extra",
    [{"optimizer": "adam", "no-use-distributed-optimizer": True}, {"kl-target": 0.05}],
    ids=["dense-adam-replicated", "loggra-kl-control"],
)
def test_nonfinite_gradients_skip_count_and_stop_the_run(tokenizer, tmp_path, extra):
    out = tmp_path / "run"
    argv = tiny_argv(
        tokenizer,
        **{
            "bf16": True,
            "kl-coef": 0.01,
            "train-iters": 5,
            "lr-decay-style": "linear",
            "output-dir": out,
            "max-consecutive-skipped-steps": 4,
            **extra,
        },
    )
    results = run_distributed(_nan_loss_run, 2, argv)
    for r in results:  # both ranks decide alike
        assert (
            r["stopped"] is not None
            and "4 consecutive optimizer steps were skipped" in (r["stopped"])
        )
        assert "--max-consecutive-skipped-steps" in r["stopped"]
        assert r["unchanged"] and r["lr_unchanged"] and r["scheduler_steps"] == 0
        assert r["skipped_total"] == 4
    rows = read_metrics(out)  # 2 updates per RL step: step 1 logged, step 2 stopped mid-way
    assert [row["step"] for row in rows] == [1]
    assert rows[0]["optimizer/skipped_steps"] == 2 and rows[0]["optimizer/skipped_steps_total"] == 2


def _inner_state(opt) -> list[torch.Tensor]:
    """Every state tensor of the inner (torch) optimizer, in a fixed order."""
    inner = opt.optimizer
    return [v.clone() for p in inner.state for v in inner.state[p].values() if torch.is_tensor(v)]


def _stepper_skips(rank, kind):
    """Megatron's own step() applies a NaN gradient under bf16; the stepper skips it."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

    use_dist = kind != "dense-replicated"
    model = tiny_gpt_model(hidden_size=64, bf16=True, use_cpu_initialization=True)
    ddp = wrap_ddp(model, use_distributed_optimizer=use_dist)
    base = dict(
        optimizer="adam", lr=1e-2, bf16=True, clip_grad=1.0, use_distributed_optimizer=use_dist
    )
    opt = (
        get_loggra_optimizer(
            OptimizerConfig(**base),
            [ddp],
            LoGRAConfig(loggra_sketch="gradient", loggra_rank=4, loggra_min_dim=8),
        )
        if kind == "loggra"
        else get_megatron_optimizer(OptimizerConfig(**base), [ddp])
    )
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))

    def backward(poison: bool):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens[:, :-1], torch.arange(8).expand(2, 8), None, labels=tokens[:, 1:])
        loss = loss.float().mean() * (math.nan if poison and rank == 1 else 1.0)
        loss.backward()
        ddp.finish_grad_sync()

    stepper = MegatronStepper(opt)
    backward(poison=False)
    assert stepper.step().ok  # a normal step first, so that the state is non-trivial
    before = _params(model)
    state = _inner_state(opt)
    backward(poison=True)
    prepared = stepper.step()
    after = _params(model)
    same_state = len(state) > 0 and all(
        torch.equal(a, b) for a, b in zip(state, _inner_state(opt), strict=True)
    )
    backward(poison=True)
    megatron_ok, _, _ = opt.step()  # Megatron's own step, for contrast
    megatron_nan = any(not torch.isfinite(p).all() for p in model.parameters())
    return {
        "ok": prepared.ok,
        "grad_norm": prepared.grad_norm,
        "megatron_nan": megatron_nan,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "same_state": same_state,
        "megatron_ok": megatron_ok,
    }


@pytest.mark.parametrize("kind", ["dense-replicated", "dense-distributed", "loggra"])
def test_stepper_skips_a_nan_gradient_on_one_rank_everywhere(kind):
    for r in run_distributed(_stepper_skips, 2, kind):
        assert not r["ok"] and not math.isfinite(r["grad_norm"])
        assert r["unchanged"] and r["same_state"]
        if kind != "loggra":  # Megatron applies the NaN update where the stepper skipped it
            assert r["megatron_ok"] and r["megatron_nan"]
