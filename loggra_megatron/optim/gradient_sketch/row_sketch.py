"""The row arithmetic of LoGRA on Megatron's data-parallel shards, weight by weight.

Megatron's ``DistributedOptimizer`` cuts each flattened ``[m, n]`` weight into DP slices
without regard to rows (``optim.gradient_sketch.weight_layout``). Row i of the sketch
``S = G Q`` depends only on row i of ``G``, so a rank sketches its whole rows locally and the
*split rows* (touched by two or more DP ranks) as partial sums, all-reduced over DP
(``[split rows, r]`` per weight); for a basis refresh the split rows' gradients are summed
over DP once per step and each row is *owned* by the rank holding its first element, so the
owned rows partition ``G`` for the range finder (all-reduced over DP, or TP × DP for
column-parallel weights). The derivation and the communication volumes:
``docs/optimizer.md#sharding``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loggra_megatron.optim.gradient_sketch.projection import (
    AllReduce,
    Projection,
    gaussian_test_matrix,
)
from loggra_megatron.optim.gradient_sketch.weight_layout import WeightLayout, cut_rows


def all_reduce_fn(group) -> AllReduce | None:
    """An in-place all-reduce over ``group`` (None when it has one rank or is None)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return lambda t: dist.all_reduce(t, group=group)


class RowShardedSketch:
    """Sketches, low-rank updates and basis refreshes of the weights in ``layouts`` on one
    DP rank; every method that communicates is joined by all ranks of the group, also those
    holding no slice of the weight (they pass ``None`` and contribute zeros).

    Args:
        layouts: every sketched weight, in the same order on all ranks.
        dp_rank: this rank's index in the DP group (its slice is ``dp_ranges[dp_rank]``).
        dp_reduce / tp_dp_reduce: all-reduces over DP and over TP × DP (None: one rank).
        projection: how a basis is made from gradient rows (or at random).
        device: where collective buffers live.
    """

    def __init__(
        self,
        layouts: list[WeightLayout],
        dp_rank: int,
        dp_reduce: AllReduce | None,
        tp_dp_reduce: AllReduce | None,
        projection: Projection,
        device,
    ):
        self.layouts = layouts
        self.dp_rank = dp_rank
        self.dp_reduce = dp_reduce
        self.tp_dp_reduce = tp_dp_reduce
        self.projection = projection
        self.device = device

    def sketch(self, layout, grad, basis, rows_shape) -> torch.Tensor | None:
        """``S [touched rows, r]`` of a weight on this rank from its flat fp32 gradient slice
        (None: no slice here, ``grad`` None); split rows are summed over DP (an all-reduce of
        ``[split rows, r]`` that every DP rank joins). ``rows_shape``: S's shape (a moment's)."""
        split = layout.split_rows() if self.dp_reduce is not None else []
        lo = layout.touched_rows(self.dp_rank)[0]
        edge = torch.zeros(len(split), layout.rank, device=self.device) if split else None
        s = None
        if grad is not None:
            start, end = layout.dp_ranges[self.dp_rank]
            pieces = cut_rows(grad, start, end, layout.shape[1])
            s = torch.empty(rows_shape, device=basis.device)
            s[pieces.body_rows[0] - lo : pieces.body_rows[1] - lo] = pieces.body @ basis
            for row, c0, c1, values in pieces.partial:
                s[row - lo] = values @ basis[c0:c1]
            if edge is not None:
                for row, *_ in pieces.partial:
                    edge[split.index(row)] = s[row - lo]
        if edge is not None:
            self.dp_reduce(edge)
            if s is not None:
                for row, *_ in pieces.partial:
                    s[row - lo] = edge[split.index(row)]
        return s

    def add_low_rank(self, target, layout, direction, basis, alpha) -> None:
        """``target += alpha · (direction Qᵀ)`` restricted to this rank's slice."""
        lo = layout.touched_rows(self.dp_rank)[0]
        start, end = layout.dp_ranges[self.dp_rank]
        pieces = cut_rows(target.view(-1), start, end, layout.shape[1])
        b0, b1 = pieces.body_rows
        pieces.body.addmm_(direction[b0 - lo : b1 - lo], basis.t(), alpha=alpha)
        for row, c0, c1, values in pieces.partial:
            values.add_(direction[row - lo] @ basis[c0:c1].t(), alpha=alpha)

    def gather_split_rows(self, raw_grad, to_fp32) -> dict[tuple[int, int], torch.Tensor]:
        """Full gradient rows of every split row, summed over DP (one all-reduce), by
        ``(weight, row)``. ``raw_grad(w)``: this rank's flat gradient slice of weight ``w``
        (None: none); ``to_fp32(w, piece)``: a piece of it in fp32 (only the split rows'
        pieces are converted)."""
        offsets, total = {}, 0
        for w, layout in enumerate(self.layouts):
            for row in layout.split_rows():
                offsets[(w, row)] = total
                total += layout.shape[1]
        if not total:
            return {}
        buf = torch.zeros(total, device=self.device)
        for w, layout in enumerate(self.layouts):
            grad = raw_grad(w)
            if grad is None:
                continue
            start, end = layout.dp_ranges[self.dp_rank]
            for row, c0, c1, values in cut_rows(grad.view(-1), start, end, layout.shape[1]).partial:
                o = offsets[(w, row)]
                buf[o + c0 : o + c1] = to_fp32(w, values)
        if self.dp_reduce is not None:
            self.dp_reduce(buf)
        return {key: buf[o : o + self.layouts[key[0]].shape[1]] for key, o in offsets.items()}

    def basis(self, w, grad, seed: int, settings: dict, split_rows) -> torch.Tensor | None:
        """The refreshed raw basis ``Q_raw [n, r]`` of weight ``w`` (None for a random
        projection on a rank without a slice: no collective to join). Collective over DP
        (TP × DP for column-parallel weights) unless the projection is random."""
        layout, projection = self.layouts[w], self.projection
        n, r = layout.shape[1], layout.rank
        if not projection.uses_gradient:
            if grad is None:
                return None
            return projection.sharded_basis(None, n, r, seed, settings, None, None, grad.device)
        rows, owned = self._owned_rows(w, layout, grad, split_rows)
        reduce = self.tp_dp_reduce if layout.reduce_over_tp else self.dp_reduce

        def omega_rows(k: int) -> torch.Tensor:  # Ω's rows of this rank's owned rows
            omega = gaussian_test_matrix(layout.omega_rows, k, seed, self.device, torch.float32)
            return omega[layout.global_row_index(*owned).to(self.device)]

        return projection.sharded_basis(rows, n, r, seed, settings, omega_rows, reduce, self.device)

    def _owned_rows(self, w, layout, grad, split_rows):
        """This rank's owned gradient rows ``[rows, n]`` and their local row range."""
        n = layout.shape[1]
        if grad is None:
            return torch.zeros(0, n, device=self.device), (0, 0)
        lo, hi = layout.owned_rows(self.dp_rank)
        start, end = layout.dp_ranges[self.dp_rank]
        pieces = cut_rows(grad, start, end, n)
        rows = pieces.body
        if hi > pieces.body_rows[1]:  # the tail row is split and owned here
            rows = torch.cat([rows, split_rows[(w, hi - 1)].view(1, n)])
        return rows, (lo, hi)
