"""Settings of the optimizer: Megatron's Adam hyper-parameters, LR schedule and DDP options
(``OptimConfig``), and LoGRA's own (``LoGRAConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import (
    applies,
    at_least,
    check_fields,
    one_of,
    positive,
    reject,
    valid_seed,
)
from loggra_megatron.optim.backward_sketch.row_updates import ROW_UPDATES
from loggra_megatron.optim.backward_sketch.sketch import SKETCH_MATRICES, SKETCH_REDUCTIONS
from loggra_megatron.optim.gradient_sketch.projection import PROJECTIONS
from loggra_megatron.optim.registry import (
    OPTIMIZERS,
    SKETCH_MODES,
    SKETCH_TARGETS,
    backward_sketch,
)

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _sketched(s: dict) -> bool:
    return OPTIMIZERS[s["optimizer"]].sketched


def _gradient(s: dict) -> bool:
    return _sketched(s) and not SKETCH_MODES[s["loggra_sketch"]].in_backward


def _backward(s: dict) -> bool:
    return backward_sketch(s["optimizer"], s["loggra_sketch"])


def _row_adam(s: dict) -> bool:
    return _backward(s) and ROW_UPDATES[s["loggra_row_optimizer"]].has_root


def _range_finder(s: dict) -> bool:
    return _gradient(s) and s["loggra_projection"] == "range_finder"


def gradient_setting(default):
    """A field of the gradient sketch: it applies to ``--loggra-sketch gradient`` only."""
    return applies(default, "to --optimizer loggra --loggra-sketch gradient", _gradient)


def backward_setting(default):
    """A field of the backward sketch: it applies to ``--loggra-sketch backward`` only."""
    return applies(default, "to --optimizer loggra --loggra-sketch backward", _backward)


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
class LoGRAConfig:
    """LoGRA's settings, declared once: the ``--loggra-*`` flags, and what
    ``get_loggra_optimizer`` takes beside Megatron's ``OptimizerConfig``."""

    loggra_sketch: str = loggra_setting("backward")
    """backward (LoGRA as published, the default: the sketch is formed in the backward pass,
    no dense gradient of a target exists, RowAdam; docs/optimizer.md#the-backward-sketch) |
    gradient (sketch the dense gradient: range-finder basis, Adam moments, captured energy).
    A resume keeps its checkpoint's unless this is given."""
    loggra_rank: int | None = loggra_setting(None)
    """Sketch rank per weight matrix (default: hidden size / 8; clamped to min(m, n), or to
    the narrowest target's input width with --loggra-sketch backward)."""
    loggra_targets: str = backward_setting(",".join(SKETCH_TARGETS))
    """Comma-separated linear layers sketched in the backward pass (their weights get no
    gradient and no grad buffer): any of linear_qkv, linear_proj, linear_fc1, linear_fc2."""
    loggra_refresh_interval: int = backward_setting(1)
    """Updates between redraws of the backward sketch's random projection (1: every update,
    as published)."""
    loggra_sketch_matrix: str = backward_setting("rademacher")
    """The backward sketch's projection entries: rademacher (±1/√r) | gaussian (N(0, 1/r))."""
    loggra_sketch_reduce: str = applies(
        "step",
        "to --optimizer loggra --loggra-sketch backward with the distributed optimizer",
        lambda s: _backward(s) and s["use_distributed_optimizer"],
    )
    """When the backward sketch's ``S`` is reduce-scattered over data-parallel ranks: step
    (once per update, as published; every rank holds the sketch of all rows, ``4·Σm·r``
    bytes) | microbatch (each layer's rows as its backward finishes, every micro-batch: a
    rank holds only its own rows, ``1/DP`` of that, for ``num_microbatches`` times the DP
    bytes; docs/optimizer.md#the-backward-sketch)."""
    loggra_row_optimizer: str = backward_setting("adam")
    """The backward sketch's update: adam (RowAdam, one second moment per output row) | sgd
    (the reconstructed sketch itself)."""
    loggra_row_beta2: float = applies(
        0.95, "to --loggra-sketch backward with --loggra-row-optimizer adam", _row_adam
    )
    """RowAdam's β₂, its only time constant (0.95 as in the published recipe; Adam's
    --adam-beta2 is the dense parameters')."""
    loggra_row_relative_eps: bool = applies(
        False, "to --loggra-sketch backward with --loggra-row-optimizer adam", _row_adam
    )
    """RowAdam's ε relative to the weight's rows: ε·mean_i √v̂_i instead of ε (the published
    recipe's)."""
    loggra_row_restore_norm: bool = backward_setting(False)
    """Scale each weight's direction back to its sketch's norm, D ← D·‖S‖/‖D‖: the second
    moment reweights rows without changing a weight's step length (the published recipe's)."""
    loggra_update_ratio: float | None = backward_setting(None)
    """Instead of --lr for the targets: one rate for all of them such that ‖ΔW‖_F/‖W‖_F over
    all targets together equals this (the published recipe: 6e-5), rounded to bf16; predicted-KL
    control then scales it. None: --lr."""
    freeze_non_targets: bool = backward_setting(False)
    """Train the --loggra-targets only: embeddings, output layer, norms and biases are frozen
    (no gradient, no grad buffer, no optimizer state), as in the published RL recipe."""
    loggra_update_interval: int = applies(
        200,
        "to --optimizer loggra --loggra-sketch gradient with a --loggra-projection that "
        "refreshes its basis",
        lambda s: _gradient(s) and PROJECTIONS[s["loggra_projection"]].refreshes,
    )
    """Optimizer steps between basis refreshes."""
    loggra_projection: str = gradient_setting("range_finder")
    """range_finder | svd (GaLore baseline: the all-reduced Gram matrix) | random | identity."""
    loggra_oversample: int = applies(8, "to --loggra-projection range_finder", _range_finder)
    """Extra range-finder probe vectors."""
    loggra_power_iters: int = applies(1, "to --loggra-projection range_finder", _range_finder)
    """Range-finder power iterations."""
    loggra_min_dim: int = gradient_setting(64)
    """Matrices with a (TP-local) side shorter than this are updated densely."""
    loggra_scale: float = gradient_setting(1.0)
    """α, multiplies the low-rank update."""
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
    loggra_energy_warn_threshold: float = gradient_setting(0.5)
    """Warn once when a weight family's captured energy (``loggra/captured_energy/<family>/
    mean``) stays below this for 10 consecutive RL steps; 0: never (docs/optimizer.md
    #captured-energy)."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("loggra_sketch", one_of(*SKETCH_MODES), f"one of {', '.join(SKETCH_MODES)}"),
                ("loggra_refresh_interval", positive, ">= 1"),
                (
                    "loggra_sketch_matrix",
                    one_of(*SKETCH_MATRICES),
                    f"one of {', '.join(SKETCH_MATRICES)}",
                ),
                (
                    "loggra_sketch_reduce",
                    one_of(*SKETCH_REDUCTIONS),
                    f"one of {', '.join(SKETCH_REDUCTIONS)}",
                ),
                (
                    "loggra_row_optimizer",
                    one_of(*ROW_UPDATES),
                    f"one of {', '.join(ROW_UPDATES)}",
                ),
                ("loggra_row_beta2", lambda b: 0 <= b < 1, "in [0, 1)"),
                ("loggra_update_ratio", positive, "> 0 (omit it to use --lr)"),
                ("loggra_rank", positive, ">= 1"),
                ("loggra_update_interval", positive, ">= 1"),
                ("loggra_projection", one_of(*PROJECTIONS), f"one of {', '.join(PROJECTIONS)}"),
                ("loggra_oversample", at_least(0), ">= 0"),
                ("loggra_power_iters", at_least(0), ">= 0"),
                ("loggra_min_dim", positive, ">= 1"),
                ("loggra_scale", positive, "> 0"),
                ("loggra_seed", valid_seed, "in [0, 2^63)"),
                ("loggra_energy_warn_threshold", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ],
            owner=LoGRAConfig,
        )
        targets = self.loggra_targets.split(",")
        unknown = [t for t in targets if t not in SKETCH_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            reject(
                "loggra_targets",
                self.loggra_targets,
                f"must be distinct names from {', '.join(SKETCH_TARGETS)}, comma-separated",
            )

    def targets(self) -> tuple[str, ...]:
        """``--loggra-targets`` as names."""
        return tuple(self.loggra_targets.split(","))

    def rank_for(self, hidden_size: int) -> int:
        """The sketch rank for a model of width ``hidden_size``: ``--loggra-rank``, else
        hidden size / 8 (the one default; ``LoGRAAdamW`` has none)."""
        return self.loggra_rank or max(1, hidden_size // 8)
