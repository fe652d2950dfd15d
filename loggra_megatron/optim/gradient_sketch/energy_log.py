"""The captured-energy log of a DP-sharded LoGRA optimizer: per committed step, this rank's
``(‖S‖², ‖G‖²)`` per slot (``4·global layer + family``), from the step's own sketches and
the non-finite check's gradient norms (no extra pass over the gradient). Summed over all
ranks they are whole matrices' (``optim.megatron.gradient_energy`` reads and
clears the records); a skipped step records nothing. docs/optimizer.md#captured-energy.
"""

from __future__ import annotations

from collections import deque

import torch

MAX_ENERGY_RECORDS = 4096
"""Records kept when nobody reads them (the oldest are dropped)."""


class EnergyLog:
    """``slots`` rows per record (0: nothing recorded); records live on ``device``."""

    def __init__(self, slots: int, device):
        self.slots = slots
        self.device = device
        self.records: deque[torch.Tensor] = deque(maxlen=MAX_ENERGY_RECORDS)
        """One ``[slots, 2]`` float64 record per committed step."""

    @staticmethod
    def measure(layout, dp_rank: int, sketch, norm, scale: float):
        """``(‖S‖² of the rows owned here, ‖G‖² of this slice)`` of one weight in float64: a
        split row's sketch is the full row's on every rank that touches it, so only its
        owner counts it; ``norm`` is the raw gradient's, ``scale`` the clipping still to be
        applied to it. Reads only ``S`` and a scalar."""
        lo = layout.touched_rows(dp_rank)[0]
        own_lo, own_hi = layout.owned_rows(dp_rank)
        captured = sketch[own_lo - lo : own_hi - lo].double().square().sum()
        return captured, (norm.double() * scale).square()

    def record(self, measured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Append a committed step's record from ``{slot: [measure(...) of its weights]}``
        (summed per slot: one ``index_add_``)."""
        if not self.slots:
            return
        record = torch.zeros(self.slots, 2, dtype=torch.float64, device=self.device)
        pairs = [(slot, m) for slot, ms in measured.items() for m in ms]
        if pairs:
            values = torch.stack([torch.stack(m) for _, m in pairs])
            index = torch.tensor([slot for slot, _ in pairs], device=self.device)
            record.index_add_(0, index, values.to(self.device))
        self.records.append(record)
