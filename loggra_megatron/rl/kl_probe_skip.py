"""When predicted-KL control may skip its probe trial: the quadratic model's extrapolation.

The KL of an update is ``KL(Δθ) ≈ ½ Δθᵀ F Δθ``, so the last measured KL of an update,
carried to this step's update norm, ``KL_then · ‖Δθ‖² / ‖Δθ_then‖²``, predicts this step's
full-step KL, and ``α_max²`` times it the KL of the largest step the controller may commit
(``--kl-max-step-scale``; 1 by default). When even that is far below the target (under
``--kl-probe-skip-below`` × target) the probe could only confirm η = α_max, so
``ProbeSkipRule`` lets the controller commit that step without it: the committed step's
predicted KL keeps the same margin below the target whatever α_max is. Every input is the
same on every rank (all-reduced norms and KLs, step counters), so every rank decides alike
and the collectives never diverge. The rule, its safety valves and why it is safe:
docs/kl_control.md#skipping-the-probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


@dataclass
class ProbeSkipRule:
    """The skip decision and the state it needs (checkpointed with the controller)."""

    skip_below: float
    """Skip when the extrapolated KL is below this × the target (0: never skip)."""
    max_skips: int
    """At most this many consecutive skipped probes; the next step probes."""
    max_step_scale: float = 1.0
    """α_max, the η a skipped step commits (``--kl-max-step-scale``)."""
    anchor_kl: float | None = None
    """The last measured KL of an update: the probe's ``KL̂`` of the full step or, on a
    skipped step, ``kl/realized`` (measured at the committed step). None: probe next."""
    anchor_sq_norm: float | None = None
    """``‖update‖²`` of the update whose KL is ``anchor_kl`` (a skipped step's: η²·‖Δθ‖²)."""
    skips_in_row: int = 0
    """Consecutive steps that skipped the probe, up to the last one."""

    def bound(self, sq_norm: float | None, target: float, basis_refresh: bool) -> float | None:
        """This step's extrapolated full-step KL if the probe may be skipped (α_max² times
        it is below ``skip_below × target``), else None: never without a measured anchor
        (the first step, after a non-finite KL), after ``max_skips`` skips in a row, on a
        basis-refresh step (its update lies in a new subspace), or without this step's
        update norm."""
        if self.skip_below <= 0 or basis_refresh or self.skips_in_row >= self.max_skips:
            return None
        if not (_finite(sq_norm) and _finite(self.anchor_kl) and _finite(self.anchor_sq_norm)):
            return None
        if self.anchor_sq_norm <= 0:  # a zero update (lr 0) says nothing about the next one
            return None
        extrapolated = self.anchor_kl * sq_norm / self.anchor_sq_norm
        committed = extrapolated * self.max_step_scale**2
        return extrapolated if committed < self.skip_below * target else None

    def update(self, skipped: bool, kl: float | None, sq_norm: float | None) -> None:
        """After a step: ``kl`` is the KL this step measured of an update of ``‖update‖²
        = sq_norm`` (the probe's ``KL̂`` of the full step, or ``kl/realized`` of a skipped
        step's committed one; None: none measured)."""
        self.skips_in_row = self.skips_in_row + 1 if skipped else 0
        if kl is None and skipped:
            return  # the anchor stays that of the last measurement
        if _finite(kl) and _finite(sq_norm) and kl >= 0:
            self.anchor_kl, self.anchor_sq_norm = kl, sq_norm
        else:  # nothing trustworthy measured: probe next
            self.anchor_kl = self.anchor_sq_norm = None

    def state_dict(self) -> dict:
        return {
            "anchor_kl": self.anchor_kl,
            "anchor_sq_norm": self.anchor_sq_norm,
            "skips_in_row": self.skips_in_row,
        }

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint without the rule's state (older) leaves no anchor: probe first."""
        self.anchor_kl = state.get("anchor_kl")
        self.anchor_sq_norm = state.get("anchor_sq_norm")
        self.skips_in_row = state.get("skips_in_row", 0)
