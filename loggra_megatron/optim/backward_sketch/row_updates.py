"""The row updates of the backward sketch (``--loggra-row-optimizer``): how ``RowAdam``
turns a row block's sketch ``S`` (``[k, r]``, fp32) into its direction ``D``, and the state
each keeps per row (``optim.backward_sketch.row_adam`` has the whole update and the paper's citation).

    adam:  v ← β₂ v + (1 − β₂) · mean_j S_ij²    D = S / (√(v / (1 − β₂ᵗ)) + ε)
    sgd:   D = S

Each gives ``(its new state, a numerator N [k, r], a per-row root [k] or None)`` and
``D = N / (root + ε)`` row by row, or ``N``.

A row update is one class here and one line in ``ROW_UPDATES``: ``RowAdam`` applies its
direction, ``--loggra-relative-eps`` and ``--loggra-row-beta2`` apply to the updates with a
root (``has_root``), and the memory model counts ``state_bytes_per_row`` (RowAdam's state
on the training GPUs, ``memory/backward_sketch.py``). Torch is not imported here: the
memory model reads the entries without it.
"""

from __future__ import annotations

from typing import ClassVar


class RowUpdate:
    """A row update with no state: ``D = S``."""

    name: ClassVar[str] = ""
    state_bytes_per_row: ClassVar[int] = 0
    """fp32 state per row of a target's master (the memory model reads it)."""
    has_root: ClassVar[bool] = False
    """``D`` divides ``S`` by a per-row root plus ε (``--loggra-relative-eps`` rescales that
    ε, and ``--loggra-row-beta2`` is its decay)."""

    def init_state(self, p) -> dict:
        """The state of row block ``p`` (``[k, n]``), zeros."""
        return {}

    def update(self, sketch, state: dict, beta2: float, step: int) -> tuple[dict, object, object]:
        """``(the new state, N, the per-row root or None)`` of ``sketch`` at update ``step``
        (1-based), computed aside: ``state`` is unchanged."""
        return {}, sketch, None


class RowAdamRoot(RowUpdate):
    """RowAdam: one fp32 second moment per row, bias-corrected."""

    name = "adam"
    state_bytes_per_row = 4
    has_root = True

    def init_state(self, p) -> dict:
        return {"exp_avg_sq": p.new_zeros(p.shape[0]).float()}

    def update(self, sketch, state: dict, beta2: float, step: int) -> tuple[dict, object, object]:
        new_v = state["exp_avg_sq"] * beta2 + sketch.square().mean(dim=1) * (1 - beta2)
        return {"exp_avg_sq": new_v}, sketch, (new_v / (1 - beta2**step)).sqrt_()


class RowSGD(RowUpdate):
    """Row SGD: the sketch itself."""

    name = "sgd"


ROW_UPDATES: dict[str, RowUpdate] = {u.name: u for u in (RowAdamRoot(), RowSGD())}
"""``--loggra-row-optimizer``, by name."""
