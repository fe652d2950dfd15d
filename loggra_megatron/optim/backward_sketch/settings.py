"""The backward sketch's own flags (``--loggra-sketch backward``), declared here and named by
its ``SKETCH_MODES`` entry (``settings``). ``optim.config.LoGRAConfig`` gathers them: each
applies to ``--optimizer loggra --loggra-sketch backward`` (and to what its own ``applies``
adds), and this class validates them."""

from __future__ import annotations

from dataclasses import dataclass

from loggra_megatron.config import applies, check_fields, one_of, positive, reject
from loggra_megatron.optim.backward_sketch.row_updates import ROW_UPDATES
from loggra_megatron.optim.backward_sketch.sketch import SKETCH_MATRICES, SKETCH_REDUCTIONS
from loggra_megatron.optim.registry import SKETCH_TARGETS


def _row_root(s: dict) -> bool:
    return ROW_UPDATES[s["loggra_row_optimizer"]].has_root


@dataclass
class BackwardSketchSettings:
    """The backward sketch's targets, projection, reduction and row update."""

    loggra_targets: str = ",".join(SKETCH_TARGETS)
    """Comma-separated linear layers sketched in the backward pass (their weights get no
    gradient and no grad buffer): any of linear_qkv, linear_proj, linear_fc1, linear_fc2."""
    loggra_refresh_interval: int = 1
    """Updates between redraws of the backward sketch's random projection (1: every update,
    as published)."""
    loggra_sketch_matrix: str = "rademacher"
    """The backward sketch's projection entries: rademacher (±1/√r) | gaussian (N(0, 1/r))."""
    loggra_sketch_reduce: str = applies(
        "step", "with the distributed optimizer", lambda s: s["use_distributed_optimizer"]
    )
    """When the backward sketch's ``S`` is reduce-scattered over data-parallel ranks: step
    (once per update, as published; every rank holds the sketch of all rows, ``4·Σm·r``
    bytes) | microbatch (each layer's rows as its backward finishes, every micro-batch: a
    rank holds only its own rows, ``1/DP`` of that, for ``num_microbatches`` times the DP
    bytes; docs/optimizer.md#the-backward-sketch)."""
    loggra_row_optimizer: str = "adam"
    """The backward sketch's update: adam (RowAdam, one second moment per output row) | sgd
    (the reconstructed sketch itself)."""
    loggra_row_beta2: float = applies(
        0.95, "with a --loggra-row-optimizer that divides by a root (adam)", _row_root
    )
    """RowAdam's β₂, its only time constant (0.95 as in the published recipe; Adam's
    --adam-beta2 is the dense parameters')."""
    loggra_row_relative_eps: bool = applies(
        False, "with a --loggra-row-optimizer that divides by a root (adam)", _row_root
    )
    """RowAdam's ε relative to the weight's rows: ε·mean_i √v̂_i instead of ε (the published
    recipe's)."""
    loggra_row_restore_norm: bool = False
    """Scale each weight's direction back to its sketch's norm, D ← D·‖S‖/‖D‖: the second
    moment reweights rows without changing a weight's step length (the published recipe's)."""
    loggra_update_ratio: float | None = None
    """Instead of --lr for the targets: one rate for all of them such that ‖ΔW‖_F/‖W‖_F over
    all targets together equals this (the published recipe: 6e-5), rounded to bf16; predicted-KL
    control then scales it. None: --lr."""
    freeze_non_targets: bool = False
    """Train the --loggra-targets only: embeddings, output layer, norms and biases are frozen
    (no gradient, no grad buffer, no optimizer state), as in the published RL recipe."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("loggra_refresh_interval", positive, ">= 1"),
                *(
                    (name, one_of(*choices), f"one of {', '.join(choices)}")
                    for name, choices in (
                        ("loggra_sketch_matrix", SKETCH_MATRICES),
                        ("loggra_sketch_reduce", SKETCH_REDUCTIONS),
                        ("loggra_row_optimizer", ROW_UPDATES),
                    )
                ),
                ("loggra_row_beta2", lambda b: 0 <= b < 1, "in [0, 1)"),
                ("loggra_update_ratio", positive, "> 0 (omit it to use --lr)"),
            ],
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
