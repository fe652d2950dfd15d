"""The actor's GRPO update through Megatron's schedule: TP=2 gives TP=1's weights."""

from functools import partial

import pytest
import torch
from shared_launch import shared_run

from loggra_megatron.testing import run_distributed, tiny_gpt_model, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

HIDDEN, HEADS, VOCAB, SEQ, BATCH = 32, 4, 64, 8, 8
LR = 0.5


def _grpo_batch():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[:, 3:] = True  # positions 0-2 are the prompt
    return {
        "tokens": tokens,
        "mask": mask,
        "old": -4.0 + 0.3 * torch.randn(BATCH, SEQ, generator=gen),
        "ref": -4.0 + 0.3 * torch.randn(BATCH, SEQ, generator=gen),
        "adv": torch.randn(BATCH, generator=gen),
    }


def _one_grpo_step(rank, pad_to: int = 1):
    """Weight deltas of one GRPO step (SGD, so Δ = −lr·grad) with the trainer's loss path;
    ``pad_to``: micro-batches right-padded as the schedule pads them for FP8 / SP."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.model.forward import pad_micro_batch
    from loggra_megatron.rl.actor import forward_backward, split_micro
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss

    model = tiny_gpt_model(
        num_layers=2,
        hidden_size=HIDDEN,
        heads=HEADS,
        vocab=VOCAB,
        seq=SEQ,
        use_cpu_initialization=True,
    )
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    config = OptimizerConfig(
        optimizer="sgd",
        lr=LR,
        sgd_momentum=0.0,
        weight_decay=0.0,
        clip_grad=0.0,
        use_distributed_optimizer=False,
    )
    opt = get_megatron_optimizer(config, [ddp])
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    batch = _grpo_batch()
    loss = PPOClipLoss(PolicyLossConfig(), SEQ, AdaptiveKLCoefficient(0.1))
    loss_fn = partial(loss, counts=(float(batch["mask"].sum()), float(BATCH)))
    micro = [pad_micro_batch(b, pad_to) for b in split_micro(batch, 4)]
    assert all((b["tokens"].shape[1] - 1) % pad_to == 0 for b in micro)
    outs = forward_backward(ddp, opt, micro, loss_fn, dp=1)
    ok, _, _ = opt.step()
    assert ok
    return {
        "delta": {n: p.detach() - before[n] for n, p in ddp.module.named_parameters()},
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "loss": sum(float(o["loss/total"]) for o in outs),
    }


def _gather(results, name):
    """The TP=1 layout of a parameter from its TP shards (SwiGLU fc1: [gate; up] halves)."""
    shards = [r["delta"][name] for r in sorted(results, key=lambda r: r["tp_rank"])]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if any(part in name for part in ("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(shards, dim=1)
    if any(part in name for part in ("linear_qkv.weight", "word_embeddings", "output_layer")):
        return torch.cat(shards, dim=0)
    return shards[0]  # replicated (norms)


def test_one_grpo_step_at_tp2_updates_the_weights_as_tp1():
    """fp32, SGD: every parameter's update at TP=2 equals TP=1's to 2e-5 relative (measured
    ≤ 1.4e-6: the reductions differ only in summation order); the vocab-parallel gradient
    bug this guards against gave 0.66."""
    (tp1,) = shared_run(_one_grpo_step, 1)
    tp2 = run_distributed(_one_grpo_step, 2, tp=2)
    assert abs(tp2[0]["loss"] - tp1["loss"]) < 1e-5
    for name, ref in tp1["delta"].items():
        assert ref.norm() > 0, name
        err = ((_gather(tp2, name) - ref).norm() / ref.norm()).item()
        assert err < 2e-5, f"{name}: TP=2 update differs from TP=1 by {err:.2e} (relative)"


def test_padding_for_fp8_and_sequence_parallel_changes_no_update():
    """Micro-batches padded to 16 positions (FP8 GEMM alignment; SEQ is 8) carry no loss:
    the same loss and weight updates as unpadded, to round-off."""
    (plain,) = shared_run(_one_grpo_step, 1)  # the launch of the test above
    (padded,) = run_distributed(_one_grpo_step, 1, pad_to=16)
    assert abs(padded["loss"] - plain["loss"]) < 1e-6
    for name, ref in plain["delta"].items():
        torch.testing.assert_close(padded["delta"][name], ref, rtol=1e-5, atol=1e-7)


def test_sequence_multiple():
    """TP under sequence parallelism, 16 under FP8 (32 for MXFP8), TP × 16 together: the
    local sequence shard TE checks under SP must be aligned itself."""
    from types import SimpleNamespace

    from loggra_megatron.model.forward import fp8_alignment, sequence_multiple

    def cfg(sp=False, tp=1, fp8=None, recipe="delayed"):
        return SimpleNamespace(
            sequence_parallel=sp, tensor_model_parallel_size=tp, fp8=fp8, fp8_recipe=recipe
        )

    assert sequence_multiple(cfg()) == 1
    assert sequence_multiple(cfg(sp=True, tp=8)) == 8
    assert sequence_multiple(cfg(tp=8, fp8="hybrid")) == 16
    assert sequence_multiple(cfg(sp=True, tp=3, fp8="hybrid")) == 48
    assert fp8_alignment(cfg(fp8="e4m3", recipe="Fp8Recipe.mxfp8")) == 32
    # TE's rule on the local [s/TP, b, h] shard, for every TP, micro-batch and length
    for tp in (1, 2, 4, 8):
        for recipe, align in (("delayed", 16), ("mxfp8", 32)):
            multiple = sequence_multiple(cfg(sp=tp > 1, tp=tp, fp8="hybrid", recipe=recipe))
            for s in range(1, 300):
                padded = s + (-s % multiple)
                for b in (1, 2, 3):
                    assert (padded // tp * b) % 8 == 0 and padded % tp == 0
                    assert (padded // tp) % align == 0, (tp, recipe, s)


def test_step_metrics_are_means_over_updates_but_controller_time_is_summed():
    """With 2 optimizer updates per RL step, ``time/kl_control_s`` adds up (it is compared
    with ``time/step_s``), skipped steps are counted, and the rest are means."""
    from loggra_megatron.rl.actor import Actor
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss

    per_update = iter(
        [
            {"time/kl_control_s": 0.25, "kl/step_scale": 1.0, "optimizer/skipped_steps": 0.0},
            {"time/kl_control_s": 0.5, "kl/step_scale": 0.5, "optimizer/skipped_steps": 1.0},
        ]
    )

    class Step:
        begin = staticmethod(lambda mini: None)

        def __call__(self, mini, update):
            return next(per_update)

    loss = PPOClipLoss(PolicyLossConfig(clip_high=0.2), SEQ, AdaptiveKLCoefficient(0.0))
    actor = Actor(
        policy=None,
        optimizer=None,
        optimizer_step=Step(),
        loss=loss,
        dp_group=None,
        micro_batch_size=1,
        global_batch_size=4,
    )
    actor.train_on = lambda mini, loss_fn: [{"loss/total": 1.0}]
    batch = _grpo_batch()
    metrics = actor.update_policy(batch, ppo_epochs=1)  # 8 sequences, 4 per update
    assert metrics["time/kl_control_s"] == 0.75
    assert metrics["optimizer/skipped_steps"] == 1.0
    assert metrics["kl/step_scale"] == 0.75
