"""Settings of the optimizer: Megatron's Adam hyper-parameters, LR schedule and DDP options
(``OptimConfig``), and LoGRA's own (``LoGRAConfig``): those of every sketching optimizer
(``LoGRASettings``) and those each ``--loggra-sketch`` mode declares in its own settings
class (its ``SKETCH_MODES`` entry's ``settings``), each applying to its mode only."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import (
    AppliesWhen,
    applies,
    at_least,
    check_fields,
    chosen_section,
    one_of,
    positive,
    valid_seed,
)
from loggra_megatron.optim.registry import OPTIMIZERS, SKETCH_MODES, resolve

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _sketched(s: dict) -> bool:
    return OPTIMIZERS[s["optimizer"]].sketched


def loggra_setting(default):
    """A LoGRA field: it applies to a sketching ``--optimizer`` only."""
    return applies(default, "to --optimizer loggra (a sketching optimizer)", _sketched)


@dataclass
class OptimConfig:
    """The optimizer, its schedule and Megatron's DDP / distributed-optimizer options."""

    optimizer: str = "loggra"
    """adam (Megatron's dense Adam) | loggra (see loggra_megatron.optim.registry)."""
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = applies(
        0.0, "with --lr-decay-style linear or cosine", lambda s: s["lr_decay_style"] != "constant"
    )
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warm-up."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm (0: off)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter with the backward pass."""
    overlap_param_gather: bool = applies(
        False, "with the distributed optimizer", lambda s: s["use_distributed_optimizer"]
    )
    """Overlap the parameter all-gather with the next forward pass."""
    grad_reduce_in_bf16: bool = applies(False, "with --bf16 parameters", lambda s: s["bf16"])
    """Accumulate and reduce-scatter gradients in bf16 instead of fp32 (needs --bf16). LoGRA
    then reads them without Megatron's fp32 copy (see --loggra-fp32-grad-copy)."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("optimizer", one_of(*OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)}"),
                ("lr", at_least(0), ">= 0"),
                ("min_lr", at_least(0), ">= 0"),
                ("lr_warmup_iters", at_least(0), ">= 0"),
                (
                    "lr_decay_style",
                    one_of(*LR_DECAY_STYLES),
                    f"one of {', '.join(LR_DECAY_STYLES)}",
                ),
                ("weight_decay", at_least(0), ">= 0"),
                ("adam_beta1", lambda b: 0 <= b < 1, "in [0, 1)"),
                ("adam_beta2", lambda b: 0 <= b < 1, "in [0, 1)"),
                ("adam_eps", positive, "> 0"),
                ("clip_grad", at_least(0), ">= 0 (0: no clipping)"),
            ],
        )


@dataclass
class LoGRASettings:
    """The settings of every sketching ``--optimizer`` (``LoGRAConfig`` adds each mode's)."""

    loggra_sketch: str = loggra_setting("backward")
    """backward (LoGRA as published, the default: the sketch is formed in the backward pass,
    no dense gradient of a target exists, RowAdam; docs/optimizer.md#the-backward-sketch) |
    gradient (sketch the dense gradient: range-finder basis, Adam moments, captured energy).
    A resume keeps its checkpoint's unless this is given."""
    loggra_rank: int | None = loggra_setting(None)
    """Sketch rank per weight matrix (default: hidden size / 8; clamped to min(m, n), or to
    the narrowest target's input width with --loggra-sketch backward)."""
    loggra_seed: int | None = loggra_setting(None)
    """Base seed of the range finder's Gaussian test matrices, or of the backward sketch's
    projections (default: --seed; 0 outside pretrain_rl.py)."""
    loggra_fp32_grad_copy: bool = applies(
        False,
        "to --optimizer loggra with --grad-reduce-in-bf16",
        lambda s: _sketched(s) and s["grad_reduce_in_bf16"],
    )
    """With --grad-reduce-in-bf16: let Megatron copy every gradient shard to fp32 before the
    step (4 bytes/param) instead of LoGRA converting one weight at a time."""
    loggra_param_remainders: bool = loggra_setting(False)
    """Keep each bf16 weight's fp32 master as the weight plus a 16-bit remainder (exact, 2
    instead of 4 bytes/param; needs --bf16 and the distributed optimizer)."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("loggra_sketch", one_of(*SKETCH_MODES), f"one of {', '.join(SKETCH_MODES)}"),
                ("loggra_rank", positive, ">= 1"),
                ("loggra_seed", valid_seed, "in [0, 2^63)"),
            ],
            owner=LoGRASettings,
        )

    def rank_for(self, hidden_size: int) -> int:
        """The sketch rank for a model of width ``hidden_size``: ``--loggra-rank``, else
        hidden size / 8 (the one default; ``LoGRAAdamW`` has none)."""
        return self.loggra_rank or max(1, hidden_size // 8)


def loggra_section(modes) -> type:
    """``LoGRAConfig`` of the sketch modes ``modes`` (``{name: SketchMode}``): the fields of
    ``LoGRASettings`` and of each mode's ``settings`` class, each of the latter applying to
    ``--optimizer loggra --loggra-sketch <its mode>`` only; it subclasses the modes' classes,
    so their methods (``targets()``) are its own."""
    return chosen_section(
        "LoGRAConfig",
        {name: resolve(mode.settings) for name, mode in modes.items() if mode.settings},
        "loggra_sketch",
        doc=(
            "LoGRA's settings, declared once: the ``--loggra-*`` flags, and what "
            "``get_loggra_optimizer`` takes beside Megatron's ``OptimizerConfig``."
        ),
        module=__name__,
        base=LoGRASettings,
        requires=AppliesWhen("--optimizer loggra", _sketched),
        inherit=True,
    )


LoGRAConfig = loggra_section(SKETCH_MODES)
"""LoGRA's settings: ``LoGRASettings`` and every sketch mode's own (``loggra_section``)."""
