"""Micro-batches by length: rows of similar length share a micro-batch, each micro-batch cut
to its own longest row, and the padding the forwards are fed counted.

A batch (``tokens [B, L]`` and its ``[B, L - 1]`` and ``[B]`` tensors) has one width, the
longest row of the rank's rollout; a micro-batch cut from it in row order pads every row to
that width. ``micro_batches`` sorts the rows by the positions each needs
(``needed_lengths``: up to its last counted target; stable, longest first) and cuts
every micro-batch to its longest row; the schedule then rounds the width up to the model's
``sequence_multiple`` (and, under PP, to the longest of
the call). Causal attention makes a row's logits at position ``t`` depend on positions
``≤ t`` only, so a row's outputs are the same (to float round-off) at any width and next to
any rows; the grouped micro-batches carry their rows' indices (``ROWS``) so that
forward-only results go back to the batch's order (``scatter_rows``).
``PaddingStats`` counts fed slots and the real ones among them
(``throughput/padded_token_fraction*``). Why and measurements: docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loggra_megatron.model.packing import PACKED

LENGTHS = "lengths"
"""Key of a micro-batch: ``[b]`` the fed positions each row needs (the rest is padding)."""
ROWS = "rows"
"""Key of a grouped micro-batch: ``[b]`` the index of each of its rows in the batch."""


def needed_lengths(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` fed positions each row needs for the targets ``mask [B, s]`` marks: one past
    its last marked position (at least 1)."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * positions).amax(dim=1).clamp(min=1).long()


def fed_lengths(batch: dict) -> torch.Tensor:
    """``[b]`` the fed positions each row of a micro-batch needs: its ``LENGTHS``
    (within ``1 .. s``), all ``s`` without them."""
    tokens = batch["tokens"]
    seq = tokens.shape[1] - 1
    lengths = batch.get(LENGTHS)
    if lengths is None:
        return torch.full((tokens.shape[0],), seq, device=tokens.device)
    return lengths.to(tokens.device).clamp(1, seq)


def _cut(batch: dict, rows: torch.Tensor | slice, width: int) -> dict:
    """Rows ``rows`` of ``batch``, its ``tokens`` cut to ``width + 1`` and its ``[B, s]``
    tensors to ``width``."""
    seq = batch["tokens"].shape[1] - 1
    out = {}
    for key, value in batch.items():
        value = value[rows]
        if value.ndim >= 2 and key == "tokens":
            value = value[:, : width + 1]
        elif value.ndim >= 2 and value.shape[1] == seq:
            value = value[:, :width]
        out[key] = value
    return out


def micro_batches(
    batch: dict, micro_batch_size: int, lengths: torch.Tensor, group: bool = True
) -> list[dict]:
    """``batch`` as micro-batches of ``micro_batch_size`` rows, each with ``LENGTHS``.

    ``group``: the rows sorted by ``lengths`` (stable, longest first), each micro-batch cut
    to its longest row and carrying ``ROWS``; else in row order at the batch's width (the
    batching before length grouping). Which rows form a micro-batch changes no loss whose
    denominators are the mini-batch's (``docs/losses.md``)."""
    n = len(batch["tokens"])
    lengths = lengths.to(batch["tokens"].device)
    full = batch["tokens"].shape[1] - 1
    batch = {**batch, LENGTHS: lengths}
    if not group:
        return [
            _cut(batch, slice(i, i + micro_batch_size), full) for i in range(0, n, micro_batch_size)
        ]
    order = torch.sort(lengths, descending=True, stable=True).indices
    batch[ROWS] = torch.arange(n, device=lengths.device)
    out = []
    for i in range(0, n, micro_batch_size):
        rows = order[i : i + micro_batch_size]
        out.append(_cut(batch, rows, min(full, int(lengths[rows].max()))))
    return out


def row_indices(micro: list[dict]) -> list[torch.Tensor]:
    """The batch index of every row of each micro-batch: its ``ROWS``, or consecutive
    rows for micro-batches in row order."""
    out, start = [], 0
    for batch in micro:
        rows = len(batch["tokens"])
        index = batch.get(ROWS)
        out.append(torch.arange(start, start + rows) if index is None else index)
        start += rows
    return out


def scatter_rows(
    parts: list[torch.Tensor], index: list[torch.Tensor], rows: int, width: int = 0
) -> torch.Tensor:
    """The results ``parts`` (``[b_i, s_i, ...]`` of the rows ``index[i]``, e.g.
    ``row_indices``) as one ``[rows, max(width, s_i), ...]`` tensor in the batch's row
    order, zeros past each part's width."""
    width = max(width, *(p.shape[1] for p in parts))
    out = parts[0].new_zeros((rows, width, *parts[0].shape[2:]))
    for part, where in zip(parts, index, strict=True):
        out[where.to(out.device), : part.shape[1]] = part
    return out


@dataclass
class PaddingStats:
    """Token slots fed to the forwards of a phase, and the real ones among them."""

    real: float = 0.0
    slots: float = 0.0

    def count(self, batch: dict) -> None:
        """Add a (padded) micro-batch: ``b × s`` slots, of which each row's
        ``LENGTHS`` (all ``s`` without it) are real; a packed one: its packed slots."""
        packed = batch.get(PACKED)
        if packed is not None:
            self.real += packed.num_real
            self.slots += packed.num_slots
            return
        rows, seq = batch["tokens"].shape[0], batch["tokens"].shape[1] - 1
        self.real += float(fed_lengths(batch).sum())
        self.slots += rows * seq

    @property
    def fraction(self) -> float:
        """Share of the slots that are padding (0 when nothing was fed)."""
        return 1.0 - self.real / self.slots if self.slots else 0.0
