"""One GRPO update through the actor on rows of very different lengths, under each micro-batch
layout (in row order, length-grouped, packed): what ``test_length_grouping.py`` and
``test_sequence_packing.py`` compare."""

import torch

from loggra_megatron.model.batching import needed_lengths
from loggra_megatron.testing import tiny_gpt_model, wrap_ddp

HIDDEN, HEADS, VOCAB, SEQ, ROWS_PER_RANK = 32, 4, 64, 32, 8
PROMPT = 3
LAYOUTS = ("plain", "grouped", "packed")


def mixed_length_batch(rank: int) -> dict:
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


class ReferenceKeepingStep:
    """The actor's optimizer step: a plain Megatron step; its update keeps the probe
    reference of 3 rows from the training forward (the ``full`` estimator's logits)."""

    def __init__(self, opt):
        self.opt, self.reference = opt, None

    def begin(self, mini):
        from loggra_megatron.rl.kl_control import KLUpdate

        rows = (mini["tokens"][:3], mini["mask"][:3])
        return KLUpdate(rows, split=3, keep_logits=True)

    def __call__(self, mini, update=None):
        # the last pipeline stage holds it (None elsewhere)
        self.reference = update.collector.result(mini["tokens"].shape[1] - 1)
        ok, grad_norm, _ = self.opt.step()
        assert ok
        return {"grad/norm": grad_norm}


def one_update(rank, layout: str, aggregation: str = "token_mean", te: bool = False, **config):
    """One GRPO update (SGD: Δ = −lr·grad) through the actor, and the log-probs of the
    forward-only pass, with the micro-batches of ``layout``. ``te``: the stand-in
    Transformer Engine layers of ``gpu_standins`` (fp32: TE's attention backend rule off),
    which ``packed`` needs; ``config``: ``TransformerConfig`` fields."""
    import gpu_standins
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.model.log_probs import compute_log_probs
    from loggra_megatron.rl.actor import Actor
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss

    if te:
        gpu_standins.install_transformer_engine()
        gpu_standins.ThdDotProductAttention.dtype_rule = False
    model = tiny_gpt_model(
        hidden_size=HIDDEN,
        heads=HEADS,
        vocab=VOCAB,
        seq=SEQ,
        use_cpu_initialization=True,
        use_te=te,
        sequence_packing=layout == "packed",
        **config,
    )
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    sgd = OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0)
    opt = get_megatron_optimizer(sgd, [ddp])
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    batch = mixed_length_batch(ps.get_data_parallel_rank())
    lengths = needed_lengths(batch["mask"])
    group = layout == "grouped"
    log_probs = compute_log_probs(
        ddp, batch["tokens"], micro_batch_size=3, lengths=lengths, group=group
    )
    loss = PPOClipLoss(
        PolicyLossConfig(loss_aggregation=aggregation),
        SEQ,
        AdaptiveKLCoefficient(0.1),
    )
    step = ReferenceKeepingStep(opt)
    dp = ps.get_data_parallel_world_size()
    actor = Actor(
        policy=ddp,
        optimizer=opt,
        optimizer_step=step,
        loss=loss,
        dp_group=ps.get_data_parallel_group(),
        micro_batch_size=2,
        global_batch_size=dp * ROWS_PER_RANK,
        length_grouping=group,
    )
    metrics = actor.update_policy(batch, ppo_epochs=1)
    return {
        "metrics": metrics,
        "delta": {n: p.detach() - before[n] for n, p in ddp.module.named_parameters()},
        "log_probs": log_probs,
        "mask": batch["mask"],
        "reference": step.reference,
        "record": dict(gpu_standins.RECORD),
    }
