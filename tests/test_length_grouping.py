"""Length-grouped micro-batches (``--length-grouping``, issue 25): rows of similar length share
a micro-batch cut to its longest row; the loss, the gradients, the update and the log-probs
are those of the micro-batches in row order, to float round-off."""

from types import SimpleNamespace

import pytest
import torch

from loggra_megatron.model.batching import (
    LENGTHS,
    ROWS,
    PaddingStats,
    micro_batches,
    needed_lengths,
    row_indices,
    scatter_rows,
)
from loggra_megatron.testing import run_distributed, tiny_gpt_model, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

HIDDEN, HEADS, VOCAB, SEQ, ROWS_PER_RANK = 32, 4, 64, 32, 8
PROMPT = 3


def _batch(rank: int) -> dict:
    """Rows of very different lengths (4 … 32 fed positions), padded with token 0."""
    gen = torch.Generator().manual_seed(100 + rank)
    lengths = torch.tensor([32, 5, 17, 4, 29, 8, 12, 6]).roll(rank)
    tokens = torch.randint(1, VOCAB, (ROWS_PER_RANK, SEQ + 1), generator=gen)
    pos = torch.arange(SEQ)
    mask = (pos >= PROMPT - 1) & (pos < lengths.unsqueeze(1))  # targets up to the row's end
    tokens[:, 1:] = torch.where(pos < lengths.unsqueeze(1), tokens[:, 1:], 0)
    return {
        "tokens": tokens,
        "mask": mask,
        "old": torch.where(mask, -4.0 + 0.3 * torch.randn(mask.shape, generator=gen), 0.0),
        "ref": torch.where(mask, -4.0 + 0.3 * torch.randn(mask.shape, generator=gen), 0.0),
        "adv": torch.randn(ROWS_PER_RANK, generator=gen),
    }


def test_needed_lengths_and_grouped_micro_batches():
    batch = _batch(0)
    lengths = needed_lengths(batch["mask"])
    assert lengths.tolist() == [32, 5, 17, 4, 29, 8, 12, 6]
    micro = micro_batches(batch, 3, lengths)
    assert [m[ROWS].tolist() for m in micro] == [[0, 4, 2], [6, 5, 7], [1, 3]]
    assert [m["tokens"].shape[1] - 1 for m in micro] == [32, 12, 5]
    assert all(m["mask"].shape[1] == m["tokens"].shape[1] - 1 for m in micro)
    for m in micro:  # every row keeps all its targets
        assert int(m["mask"].sum()) == int(batch["mask"][m[ROWS]].sum())
    plain = micro_batches(batch, 3, lengths, group=False)
    assert all(ROWS not in m and m["tokens"].shape[1] == SEQ + 1 for m in plain)
    assert torch.equal(torch.cat([m[LENGTHS] for m in plain]), lengths)
    # results in the batch's row order, zeros past each micro-batch's width
    parts = [m["tokens"][:, 1:].float() for m in micro]
    back = scatter_rows(parts, row_indices(micro), ROWS_PER_RANK, SEQ)
    assert torch.equal(back, batch["tokens"][:, 1:].float())
    assert torch.equal(row_indices(plain)[1], torch.tensor([3, 4, 5]))


def test_padding_stats():
    stats = PaddingStats()
    assert stats.fraction == 0.0
    stats.count({"tokens": torch.zeros(2, 9), LENGTHS: torch.tensor([8, 2])})
    assert stats.fraction == pytest.approx(6 / 16)
    stats.count({"tokens": torch.zeros(1, 9)})  # no lengths: all real
    assert stats.fraction == pytest.approx(6 / 24)


class _Step:
    """The actor's optimizer step: a plain Megatron step; keeps the probe reference of 3
    rows from the training forward (the ``full`` estimator's logits)."""

    def __init__(self, opt):
        from loggra_megatron.rl.kl_probe import ReferenceCollector

        self.opt, self.collector = opt, ReferenceCollector
        self.controller = SimpleNamespace(as_reference=lambda out: out)
        self.reference = None

    def reference_collector(self, num_sequences):
        return self.collector(self.controller, 3)

    def __call__(self, mini, reference=None):
        from loggra_megatron.rl.kl_probe import ProbeOutput, widen_output

        if isinstance(reference, ProbeOutput):  # the last pipeline stage
            self.reference = widen_output(reference, mini["tokens"].shape[1] - 1)
        ok, grad_norm, _ = self.opt.step()
        assert ok
        return {"grad/norm": grad_norm}


def _one_step(rank, group: bool, aggregation: str):
    """One GRPO update at DP=2 (SGD: Δ = −lr·grad) through the actor, and the log-probs of
    the forward-only pass, with or without length grouping."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.rl.actor import Actor
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss
    from loggra_megatron.rollout import compute_log_probs

    model = tiny_gpt_model(
        hidden_size=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ, use_cpu_initialization=True
    )
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    config = OptimizerConfig(
        optimizer="sgd", lr=0.5, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0
    )
    opt = get_megatron_optimizer(config, [ddp])
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    batch = _batch(ps.get_data_parallel_rank())
    lengths = needed_lengths(batch["mask"])
    log_probs = compute_log_probs(
        ddp, batch["tokens"], micro_batch_size=3, lengths=lengths, group=group
    )
    loss = PPOClipLoss(
        PolicyLossConfig(loss_aggregation=aggregation),
        SEQ,
        AdaptiveKLCoefficient(0.1),
        ps.get_tensor_model_parallel_group(),
    )
    step = _Step(opt)
    actor = Actor(ddp, opt, step, loss, ps.get_data_parallel_group(), 2, 2 * ROWS_PER_RANK, group)
    metrics = actor.update_policy(batch, ppo_epochs=1)
    return {
        "metrics": metrics,
        "delta": {n: p.detach() - before[n] for n, p in ddp.module.named_parameters()},
        "log_probs": log_probs,
        "mask": batch["mask"],
        "reference": step.reference,
    }


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_grouped_micro_batches_give_todays_loss_update_and_log_probs(aggregation):
    """DP=2, 8 rows per rank of 4 … 32 positions, micro-batches of 2: the loss, the gradient
    norm, every weight's update (relative), the log-probs of the forward-only pass and KL
    control's kept reference agree with the micro-batches in row order to 1e-6 (each
    weight's update, a difference of fp32 sums over other micro-batch splits, to 1e-5)."""
    plain = run_distributed(_one_step, 2, False, aggregation)
    grouped = run_distributed(_one_step, 2, True, aggregation)
    for p, g in zip(plain, grouped, strict=True):
        mp, mg = p["metrics"], g["metrics"]
        assert abs(mg["loss/total"] - mp["loss/total"]) < 1e-6
        assert abs(mg["grad/norm"] - mp["grad/norm"]) < 1e-6 * mp["grad/norm"]
        assert mg["throughput/padded_token_fraction"] < 0.5 * mp["throughput/padded_token_fraction"]
        for name, ref in p["delta"].items():
            assert ref.norm() > 0, name
            err = ((g["delta"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, f"{name}: {err:.2e}"  # measured ≤ 1.6e-6 (fp32 sums)
        m = p["mask"]
        assert (g["log_probs"][m] - p["log_probs"][m]).abs().max() < 1e-6
        rp, rg = p["reference"], g["reference"]
        assert rg.logits.shape == rp.logits.shape == (3, SEQ, VOCAB)
        keep = rp.mask
        assert (rg.logits[keep] - rp.logits[keep]).abs().max() < 1e-5
        assert torch.equal(rg.targets[keep], rp.targets[keep])


def test_grouped_micro_batches_under_pipeline_parallelism():
    """PP=2: the micro-batches of one schedule call are padded to the longest of them (the
    stages exchange activations of one shape); loss, update and log-probs as in row order."""
    plain = run_distributed(_one_step, 2, False, "token_mean", pp=2)
    grouped = run_distributed(_one_step, 2, True, "token_mean", pp=2)
    last = grouped[1]
    assert abs(last["metrics"]["loss/total"] - plain[1]["metrics"]["loss/total"]) < 1e-6
    m = last["mask"]
    assert (last["log_probs"][m] - plain[1]["log_probs"][m]).abs().max() < 1e-6
    for p, g in zip(plain, grouped, strict=True):
        for name, ref in p["delta"].items():
            err = ((g["delta"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, f"{name}: {err:.2e}"
