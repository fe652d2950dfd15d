"""The policy's training side (the actor): the policy loss
(``PolicyLoss``) and the SFT loss as Megatron loss
functions, mini/micro-batching, and one optimizer step per mini-batch.

Megatron-style entry points: ``forward_step`` (``forward_step(data_iterator, model)``
with the loss bound by ``functools.partial``) and ``loss_func``, run by Megatron's
schedule (``run_schedule``, 1F1B under PP).

Each loss function returns its micro-batch's share of the *global* mini-batch loss (counts
all-reduced over DP by ``global_counts``), and ``loss_func`` multiplies by ``k·DP``
(``k`` micro-batches per rank) to undo the schedule's and DDP's averaging: the gradient is
that of the global loss, whatever the DP size and micro-batch split. Logits stay
vocab-parallel (``[b, s, V/TP]``, ``model.vocab_parallel``).

The loss convention and the metrics' sums: docs/losses.md#micro-batches-dp-and-the-gradient
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from loggra_megatron.metric_keys import add_update, combine_micro_batches, combine_updates
from loggra_megatron.model.batching import PaddingStats, micro_batches, needed_lengths
from loggra_megatron.model.forward import gpt_forward, last_hidden, run_schedule
from loggra_megatron.model.output_head import LastHidden
from loggra_megatron.rl.kl_control import KLUpdate
from loggra_megatron.rl.policy_loss import PolicyLoss

if TYPE_CHECKING:  # imports Megatron
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

LossFn = Callable[[dict, LastHidden], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(micro_batch, last_hidden) -> (share of the global loss, metrics)``."""


class OptimizerStepFn(Protocol):
    """The optimizer step of a mini-batch, plain or under predicted-KL control, skips
    counted (``OptimizerStep``)."""

    def begin(self, mini: dict[str, torch.Tensor]) -> KLUpdate | None:
        """Under predicted-KL control, the record of the mini-batch's update, whose
        ``keep_reference`` lets the training forward keep the probe's reference; else None."""
        ...

    def __call__(
        self, mini: dict[str, torch.Tensor], update: KLUpdate | None = None
    ) -> dict[str, float]: ...


def global_counts(mask: torch.Tensor, num_seqs: int, dp_group) -> tuple[float, float]:
    """``(valid tokens, sequences)`` of a mini-batch summed over the DP group (reduced on
    the mask's device: NCCL takes no host tensors)."""
    counts = torch.tensor(
        [float(mask.sum()), float(num_seqs)], dtype=torch.float64, device=mask.device
    )
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return float(counts[0]), float(counts[1])


def sft_loss_fn(num_tokens: float) -> LossFn:
    """Next-token NLL of the masked (completion) tokens over the global token count."""

    def loss_fn(batch: dict, out: LastHidden):
        nll = -out.log_probs() * batch["mask"]
        loss = nll.sum() / num_tokens
        return loss, {"loss/sft": loss}

    return loss_fn


def loss_func(loss_fn: LossFn, scale: float, model, batch: dict, output_tensor: torch.Tensor):
    """Megatron's loss function: ``scale = k·DP`` undoes the schedule's and DDP's averaging."""
    loss, metrics = loss_fn(batch, last_hidden(model, batch, output_tensor))
    return loss * scale, {k: v.detach().float() for k, v in metrics.items()}


def forward_step(loss_fn: LossFn, scale: float, data_iterator, model):
    """Megatron's forward step: feed ``tokens[:, :-1]``; the last hidden states score
    ``tokens[:, 1:]`` (in token chunks, ``model.output_head``)."""
    batch = next(data_iterator)
    return gpt_forward(model, batch), partial(loss_func, loss_fn, scale, model, batch)


def forward_backward(
    model,
    optimizer,
    micro: list[dict],
    loss_fn: LossFn,
    dp: int,
    padding: PaddingStats | None = None,
) -> list[dict]:
    """Zero the grads, then forward + backward over ``micro`` batches with Megatron's
    schedule (1F1B under PP). Returns the per-micro-batch metrics (last PP stage);
    ``padding`` counts the slots fed."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    step = partial(forward_step, loss_fn, len(micro) * dp)
    return run_schedule(model, step, micro, forward_only=False, padding=padding)


def split_micro(batch: dict, micro_batch_size: int) -> list[dict]:
    """``batch`` (tensors with the same first dimension) cut into micro-batches."""
    n = len(batch["tokens"])
    return [
        {k: v[i : i + micro_batch_size] for k, v in batch.items()}
        for i in range(0, n, micro_batch_size)
    ]


class Actor:
    """Trains the policy with ``loss``: mini-batches of ``global_batch_size / DP`` sequences,
    each run as micro-batches of ``micro_batch_size`` through Megatron's schedule and
    followed by one ``optimizer_step`` (``OptimizerStepFn``), whose ``begin`` lets the
    mini-batch's training forward keep KL control's probe reference. ``length_grouping``: a
    mini-batch's rows of similar length share a micro-batch, each cut to its longest row
    (``micro_batches``; the loss is the same, its denominators are the mini-batch's)."""

    def __init__(
        self,
        *,
        policy: DistributedDataParallel,
        optimizer: MegatronOptimizer,
        optimizer_step: OptimizerStepFn,
        loss: PolicyLoss,
        dp_group: dist.ProcessGroup | None,
        micro_batch_size: int,
        global_batch_size: int,
        length_grouping: bool = True,
    ):
        self.policy, self.optimizer, self.optimizer_step = policy, optimizer, optimizer_step
        self.loss, self.dp_group = loss, dp_group
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.micro_batch_size = micro_batch_size
        self.per_rank = global_batch_size // self.dp
        self.length_grouping = length_grouping
        self.padding = PaddingStats()
        """Slots fed to the training forwards since the last ``update_policy`` began."""

    def update_policy(self, batch: dict[str, torch.Tensor], ppo_epochs: int) -> dict[str, float]:
        """``ppo_epochs`` passes over ``batch`` (``Experience.training_batch``); returns
        the metrics of the updates, each combined over micro-batches and updates as
        declared (``metric_keys``), and the share of padding they fed."""
        sums, n = {}, 0
        self.padding = PaddingStats()
        for _ in range(ppo_epochs):
            for start in range(0, len(batch["tokens"]), self.per_rank):
                mini = {k: v[start : start + self.per_rank] for k, v in batch.items()}
                counts = global_counts(mini["mask"], self.per_rank, self.dp_group)
                loss_fn = partial(self.loss, counts=counts)
                update = self.optimizer_step.begin(mini)  # None without KL control
                if update is not None:  # the probe's reference at θ: this training forward's
                    loss_fn = update.keep_reference(loss_fn)
                outs = self.train_on(mini, loss_fn)
                step_metrics = self.optimizer_step(mini, update)
                add_update(sums, {**combine_micro_batches(outs), **step_metrics})
                n += 1
        metrics = combine_updates(sums, n)
        metrics["throughput/padded_token_fraction"] = self.padding.fraction
        return metrics

    def train_on(self, mini: dict, loss_fn: LossFn) -> list[dict]:
        """Forward + backward of one mini-batch; the per-micro-batch metrics."""
        lengths = needed_lengths(mini["mask"])
        micro = micro_batches(mini, self.micro_batch_size, lengths, self.length_grouping)
        return forward_backward(self.policy, self.optimizer, micro, loss_fn, self.dp, self.padding)
