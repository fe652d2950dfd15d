"""Settings of the training loop: steps, batch sizes, seed, warm-up and stopping."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import applies, at_least, check_fields, one_of, positive, valid_seed
from loggra_megatron.optim.registry import OPTIMIZERS
from loggra_megatron.rollout.registry import AUTO, ROLLOUT_ENGINES


def _recomputes(settings: dict) -> bool:
    """The run may recompute the old log-probs after generation: an engine that does not
    sample them (``auto`` may take one on a GPU), or ``--tis-cap``."""
    name = settings["rollout_engine"]
    engine = name == AUTO or ROLLOUT_ENGINES[name].recomputes_log_probs
    return engine or settings["tis_cap"] is not None


@dataclass
class TrainingConfig:
    """The RL loop (``--train-iters``, batch sizes, ``--seed``) and the supervised warm-up."""

    train_iters: int = 10
    """RL steps (each: rollout, rewards, then --ppo-epochs passes of optimizer steps)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    log_prob_micro_batch_size: int | None = applies(
        None,
        "with a reference model (--kl-coef > 0), --kl-target, --tis-cap or a rollout engine "
        "that recomputes the old log-probs (--rollout-engine auto or dynamic)",
        lambda s: s["kl_coef"] > 0 or s["kl_target"] is not None or _recomputes(s),
    )
    """Sequences per micro-batch of the forward-only passes (reference log-probs, KL probes,
    the old-log-prob recompute; default: --micro-batch-size)."""
    length_grouping: bool = True
    """Rows of similar length share a micro-batch, each cut to its longest row, in the
    training and log-prob forwards (within a mini-batch: the loss is the same, to float
    summation order); --no-length-grouping: micro-batches in row order at the batch's width."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    seed: int = 1234
    """Random seed (weights, sampling, data order, LoGRA's test matrices)."""
    max_consecutive_skipped_steps: int = 10
    """Stop the run (exit 1, checkpoints untouched) after this many optimizer steps in a row
    were skipped for a non-finite gradient norm or predicted KL (0: never stop)."""
    sft_iters: int = 0
    """Supervised warm-up steps on the tasks' reference solutions before RL."""
    sft_lr: float | None = applies(None, "with --sft-iters > 0", lambda s: s["sft_iters"] > 0)
    """Learning rate of the warm-up (default: --lr)."""
    sft_optimizer: str = applies("adam", "with --sft-iters > 0", lambda s: s["sft_iters"] > 0)
    """The warm-up's own optimizer, over a policy of its own (every weight with a dense
    gradient; its weights become the RL policy's when it ends): adam (Megatron's dense Adam,
    the default: a from-scratch policy learns slowly through the backward sketch's fresh
    random projections) | loggra (the --loggra-* settings of RL)."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("train_iters", at_least(0), ">= 0"),
                ("micro_batch_size", positive, ">= 1"),
                ("log_prob_micro_batch_size", positive, ">= 1"),
                ("global_batch_size", positive, ">= 1"),
                ("seed", valid_seed, "in [0, 2^63)"),
                ("max_consecutive_skipped_steps", at_least(0), ">= 0 (0: never stop)"),
                ("sft_iters", at_least(0), ">= 0"),
                ("sft_lr", at_least(0), ">= 0"),
                ("sft_optimizer", one_of(*OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)}"),
            ],
        )

    @property
    def forward_micro_batch_size(self) -> int:
        """Sequences per micro-batch of the forward-only passes."""
        return self.log_prob_micro_batch_size or self.micro_batch_size
