"""The supervised warm-up (``--sft-iters``): next-token training on the tasks' reference
solutions, so that a model trained from scratch can earn rewards before RL.

The warm-up trains a policy of its own with an optimizer of its own (``WarmupPhase``:
``--sft-optimizer``, Megatron's dense Adam by default): every weight has a dense gradient
there, also the backward sketch's targets, which the RL policy freezes for autograd. It
starts from the RL policy's weights and hands its weights back when it ends
(``copy_weights``); the RL optimizer's masters then follow them, and the phase is freed.
Each step takes a global batch of examples from the prompt stream, masks the prompt
tokens out of the loss (``sft_loss_fn``) and takes one
optimizer step at the constant ``--sft-lr`` (``constant_lr``). It reads the prompt stream
from its own position, so RL starts from the stream's beginning. It is resumable: a
checkpoint taken during it holds the phase's policy and optimizer, it continues from
``step``, and stops at a step boundary when asked (SIGTERM), leaving a consistent state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loggra_megatron.rl.actor import Actor, global_counts, sft_loss_fn
from loggra_megatron.train.preflight import Preflight
from loggra_megatron.train.run_config import RunConfig
from loggra_megatron.train.steps import SkipCounter

if TYPE_CHECKING:  # imports Megatron
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    from loggra_megatron.optim.megatron.stepper import MegatronStepper


@dataclass
class WarmupPhase:
    """The warm-up's own policy, its ``--sft-optimizer``, what steps it, and the actor that
    trains it (``train.build.warmup_phase``)."""

    policy: DistributedDataParallel
    optimizer: MegatronOptimizer
    stepper: MegatronStepper
    actor: Actor


@torch.no_grad()
def copy_weights(source, target, target_optimizer) -> None:
    """``source``'s weights into ``target`` (two DDP policies of one architecture), and
    ``target_optimizer``'s fp32 masters after them."""
    weights = dict(source.module.named_parameters())
    for name, p in target.module.named_parameters():
        p.copy_(weights[name])
    target_optimizer.reload_model_params()


@contextlib.contextmanager
def constant_lr(optimizer, lr: float) -> Iterator[None]:
    """The warm-up's learning rate: ``lr`` (× each group's ``lr_mult``) inside, the rates it
    replaced restored on exit. Megatron's ``OptimizerParamScheduler`` cannot express it: it
    reads every group's ``max_lr``, which Megatron sets to the RL ``--lr``."""
    before = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    try:
        yield
    finally:
        for group, rate in zip(optimizer.param_groups, before, strict=True):
            group["lr"] = rate


class SupervisedWarmup:
    """The warm-up's steps (module docstring); ``phase`` is None once it is done."""

    def __init__(
        self,
        phase: WarmupPhase | None,
        skips: SkipCounter,
        host: Preflight,
        cfg: RunConfig,
        device: torch.device,
        dp_rank: int,
    ):
        self.phase, self.skips = phase, skips
        self.dataset, self.device = host.dataset, device
        self.tokenizer, self.renderer, self.task = host.tokenizer, host.renderer, host.task
        self.training, self.optim = cfg.training, cfg.optimizer
        self.width = cfg.model.seq_length
        self.dp_rank = dp_rank
        self.step = 0
        """Warm-up steps done."""

    @property
    def done(self) -> bool:
        return self.step >= self.training.sft_iters

    def run(self, stop_requested, log) -> None:
        """Steps until done or ``stop_requested()``; ``log(message)`` prints progress. The
        warm-up reads the prompt stream from its own position (``step`` × global batch),
        leaving the RL position alone, and its learning rate holds only while it runs."""
        t, actor = self.training, self.phase.actor
        gbs = t.global_batch_size
        batches = self.dataset.batches(gbs, self.dp_rank, actor.dp, self.step * gbs, advance=False)
        lr = t.sft_lr if t.sft_lr is not None else self.optim.lr
        with constant_lr(actor.optimizer, lr):
            while not self.done and not stop_requested():
                self._step(next(batches), log)

    def _step(self, examples: list[dict], log) -> None:
        tokens, mask = self._batch(examples)
        actor = self.phase.actor
        n_tok, _ = global_counts(mask, len(tokens), actor.dp_group)
        outs = actor.train_on({"tokens": tokens, "mask": mask}, sft_loss_fn(n_tok))
        prepared = self.phase.stepper.step()
        self.skips.count(prepared.ok, prepared.grad_norm, f"at warm-up step {self.step + 1}")
        self.step += 1
        if outs and self.step % 10 == 0:  # the loss lives on the last pipeline stage
            share = sum(float(out["loss/sft"]) for out in outs)  # this rank's, of the loss
            # × DP: the global loss when the ranks' shares are even (not all-reduced)
            log(f" sft {self.step:5d}/{self.training.sft_iters} | loss {share * actor.dp:.4f}")

    def _batch(self, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [b, width + 1]`` (prompt, the task's reference completion, EOS, padding)
        and the loss ``mask [b, width]`` over the completion's targets."""
        tok, width = self.tokenizer, self.width
        tokens = torch.full((len(examples), width + 1), tok.pad, dtype=torch.long)
        mask = torch.zeros(len(examples), width, dtype=torch.bool)
        for i, e in enumerate(examples):
            prompt = self.renderer.ids(e["prompt"])
            answer = tok.tokenize(self.task.reference_completion(e))
            ids = (prompt + answer + [tok.eos])[: width + 1]
            tokens[i, : len(ids)] = torch.tensor(ids)
            mask[i, len(prompt) - 1 : len(ids) - 1] = True
        return tokens.to(self.device), mask.to(self.device)

    def state_dict(self) -> dict:
        return {"step": self.step, "own_stream": True}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        if not state.get("own_stream") and not self.done:
            # saved before the warm-up kept its own stream position: the data position
            # saved with it was the warm-up's; RL starts from the beginning of the stream
            self.dataset.consumed_samples = 0
