"""The policy's training side: token log-probs, the GRPO and SFT losses as Megatron loss
functions, and forward/backward over micro-batches with Megatron's schedule.

Loss convention. A mini-batch is ``G`` sequences over all DP ranks, run as ``k`` micro-batches
per rank. Each loss function returns its micro-batch's share of the *global* mini-batch loss
(its numerator over the global token or sequence count, all-reduced over DP beforehand).
Megatron's schedule divides each micro-batch loss by ``k`` and DDP averages gradients over
DP, so :func:`loss_func` multiplies by ``k·DP``: the gradient that reaches the optimizer is
the gradient of the global loss, whatever the DP size and micro-batch split.

Tensor parallelism: logits are vocab-parallel (``[b, s, V/TP]``) and never gathered; the
log-probs are :func:`~loggra_megatron.kl.vocab_parallel_log_probs` over Megatron's TP group,
whose gradient is exact at any TP size (``tests/test_vocab_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from loggra_megatron.kl import vocab_parallel_log_probs
from loggra_megatron.rl.losses import grpo_loss

LossFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(micro_batch, logits) -> (share of the global loss, metrics)``."""


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log π(targets)`` from this TP rank's vocab-parallel ``logits [b, s, V/TP]``."""
    from megatron.core import parallel_state as ps

    start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    return vocab_parallel_log_probs(logits, targets, start, ps.get_tensor_model_parallel_group())


def global_counts(mask: torch.Tensor, num_seqs: int, dp_group) -> tuple[float, float]:
    """``(valid tokens, sequences)`` of a mini-batch summed over the DP group."""
    counts = torch.tensor([float(mask.sum()), float(num_seqs)], dtype=torch.float64)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return float(counts[0]), float(counts[1])


def grpo_loss_fn(rl, kl_coef: float, num_tokens: float, num_seqs: float) -> LossFn:
    """The GRPO/PPO-clip loss of a mini-batch (``rl``: the ``RLArguments``)."""

    def loss_fn(batch: dict, logits: torch.Tensor):
        logp = token_log_probs(logits, batch["tokens"][:, 1:])
        return grpo_loss(
            logp, batch["old"], batch["adv"], batch["mask"], logp_ref=batch.get("ref"),
            kl_coef=kl_coef, kl_estimator=rl.kl_ref_estimator, clip_low=rl.clip_low,
            clip_high=rl.clip_high, aggregation=rl.loss_aggregation, num_tokens_global=num_tokens,
            num_seqs_global=num_seqs, max_len=rl.max_new_tokens,
        )  # fmt: skip

    return loss_fn


def sft_loss_fn(num_tokens: float) -> LossFn:
    """Next-token NLL of the masked (completion) tokens over the global token count."""

    def loss_fn(batch: dict, logits: torch.Tensor):
        nll = -token_log_probs(logits, batch["tokens"][:, 1:]) * batch["mask"]
        loss = nll.sum() / num_tokens
        return loss, {"loss/sft": loss}

    return loss_fn


def loss_func(loss_fn: LossFn, scale: float, batch: dict, output_tensor: torch.Tensor):
    """Megatron's loss function: ``scale = k·DP`` undoes the schedule's and DDP's averaging."""
    loss, metrics = loss_fn(batch, output_tensor)
    return loss * scale, {k: v.detach().float() for k, v in metrics.items()}


def forward_step(loss_fn: LossFn, scale: float, data_iterator, model):
    """Megatron's forward step: feed ``tokens[:, :-1]``; the logits score ``tokens[:, 1:]``."""
    batch = next(data_iterator)
    x = batch["tokens"][:, :-1]
    pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand_as(x)
    return model(x, pos, None), partial(loss_func, loss_fn, scale, batch)


def forward_backward(
    model, optimizer, micro: list[dict], loss_fn: LossFn, micro_batch_size: int, dp: int
) -> list[dict]:
    """Zero the grads, then forward + backward over ``micro`` batches with Megatron's
    schedule (1F1B under PP). Returns the per-micro-batch metrics (last PP stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    return get_forward_backward_func()(
        forward_step_func=partial(forward_step, loss_fn, len(micro) * dp),
        data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
        seq_length=micro[0]["tokens"].shape[1] - 1, micro_batch_size=micro_batch_size,
        forward_only=False,
    )  # fmt: skip


def split_micro(batch: dict, micro_batch_size: int) -> list[dict]:
    """``batch`` (tensors with the same first dimension) cut into micro-batches."""
    n = len(batch["tokens"])
    return [
        {k: v[i : i + micro_batch_size] for k, v in batch.items()}
        for i in range(0, n, micro_batch_size)
    ]


def combine_micro_metrics(outs: list[dict], dp: int) -> dict[str, float]:
    """Per-micro-batch metrics of one mini-batch: the ``loss/*`` terms are this rank's
    shares of the global loss (summed, then × DP so that the DP mean is the global sum);
    the others are averaged."""
    if not outs:
        return {}
    combined = {}
    for key in outs[0]:
        values = [float(o[key]) for o in outs]
        combined[key] = sum(values) * dp if key.startswith("loss/") else sum(values) / len(values)
    return combined
