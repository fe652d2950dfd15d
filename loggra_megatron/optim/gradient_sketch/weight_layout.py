"""Where a weight's optimizer shards live: the DP slices of a flattened ``[m, n]`` weight.

Megatron-Core's ``DistributedOptimizer`` gives each data-parallel rank a flat range
``[start, end)`` of each TP-local weight, cut without regard to rows. ``WeightLayout``
records those ranges (identically on every rank) and the weight's place in the TP=1
matrix; ``cut_rows`` splits one slice into a partial head row, a body of whole rows
(a ``[rows, n]`` view) and a partial tail row, which is the unit
``ShardedLoGRAAdamW`` sketches and updates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightLayout:
    """Where one sketched weight's optimizer shards live; identical on its DP ranks."""

    shape: tuple[int, int]
    """TP-local ``[m, n]`` of the model weight."""
    rank: int
    """Sketch rank r of this weight (already clamped)."""
    seed: int
    """Basis seed; equal on every DP and TP rank that shares the weight."""
    dp_ranges: tuple[tuple[int, int], ...]
    """Flat ``[start, end)`` of the weight held by each DP rank (``start == end``: none)."""
    row_offset: int = 0
    """Global row of local row 0 (``tp_rank·m`` for column-parallel weights)."""
    global_rows: int = 0
    """Rows of the Gaussian test matrix Ω (``tp·m`` column-parallel, else m); 0 means m."""
    reduce_over_tp: bool = False
    """Column-parallel: the basis is computed from the rows of all TP shards."""
    glu_halves: bool = False
    """Column-parallel gated FC1 (SwiGLU): each TP shard is ``[gate part; up part]``, so
    local row j maps to global row ``t·m/2 + j`` (gate) or ``M/2 + t·m/2 + j − m/2`` (up)."""
    energy_slot: int = -1
    """Row of the captured-energy buffer this weight adds to (``4·global layer + family``,
    ``optim.megatron.gradient_energy``); -1: not counted."""

    @property
    def omega_rows(self) -> int:
        return self.global_rows or self.shape[0]

    def global_row_index(self, lo: int, hi: int) -> torch.Tensor:
        """Global (TP=1) row of each local row in ``[lo, hi)``: the rows of Ω to use."""
        rows = torch.arange(lo, hi)
        if not self.glu_halves:
            return rows + self.row_offset
        half, global_half = self.shape[0] // 2, self.omega_rows // 2
        shard = self.row_offset // self.shape[0]
        gate = rows < half
        return torch.where(gate, shard * half + rows, global_half + shard * half + rows - half)

    def touched_rows(self, dp_rank: int) -> tuple[int, int]:
        start, end = self.dp_ranges[dp_rank]
        n = self.shape[1]
        return (start // n, -(-end // n)) if end > start else (0, 0)

    def owned_rows(self, dp_rank: int) -> tuple[int, int]:
        """Rows whose first element this rank holds (the owned rows partition W)."""
        start, end = self.dp_ranges[dp_rank]
        n = self.shape[1]
        return (-(-start // n), -(-end // n)) if end > start else (0, 0)

    def split_rows(self) -> list[int]:
        """Rows touched by two or more DP ranks, ascending."""
        n = self.shape[1]
        return sorted({s // n for s, e in self.dp_ranges if e > s and s % n})


@dataclass
class RowPieces:
    """A DP slice of a flattened ``[m, n]`` weight, cut at row boundaries."""

    body_rows: tuple[int, int]  # local rows [lo, hi) held whole
    body: torch.Tensor  # [hi - lo, n] view into the slice
    partial: list[tuple[int, int, int, torch.Tensor]]  # (row, c0, c1, values view)


def cut_rows(flat: torch.Tensor, start: int, end: int, n: int) -> RowPieces:
    partial, pos = [], start
    if start % n:
        hi = min(end, (start // n + 1) * n)
        partial.append((start // n, start % n, start % n + hi - start, flat[: hi - start]))
        pos = hi
    full_end = max(pos, end // n * n)
    body = flat[pos - start : full_end - start].view(-1, n)
    if end > full_end:
        partial.append((full_end // n, 0, end - full_end, flat[full_end - start :]))
    return RowPieces((pos // n, full_end // n), body, partial)
