"""The probe forward of predicted-KL control and what it returns.

``gpt_probe_forward`` runs a batch of probe rows through Megatron's forward-only schedule
(so it works under PP), grouped by length like the training forward, and returns a
``ProbeOutput`` on the last pipeline stage: the vocab-parallel logits (``full``
estimator) or the sampled tokens' log-probs (``k1``/``k2``/``k3``), the targets and the mask.
``ReferenceCollector`` keeps the probe rows' reference at θ from the training forward,
so that the controller (``rl.kl_control``) needs no forward of its own
for it. Batch and output helpers at the end. docs/kl_control.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from loggra_megatron.model.batching import (
    ROWS,
    micro_batches,
    needed_lengths,
    row_indices,
    scatter_rows,
)
from loggra_megatron.model.forward import unpadded_length
from loggra_megatron.model.output_head import LastHidden


@dataclass
class ProbeOutput:
    """What the probe forward returns on the last pipeline stage."""

    logits: torch.Tensor
    """``[b, s, V/TP]`` vocab-parallel logits, or ``[b, s]`` log-probs of the targets."""
    targets: torch.Tensor
    """``[b, s]`` the tokens that were sampled at each position."""
    mask: torch.Tensor
    """``[b, s]`` which positions count (the response tokens)."""


ProbeForward = Callable[[Any], "ProbeOutput | None"]
"""Runs the (pipelined) forward of a batch; ``ProbeOutput`` on the last stage, else None."""


class _OnLastStage:
    def __repr__(self) -> str:
        return "REFERENCE_ON_LAST_STAGE"


REFERENCE_ON_LAST_STAGE = _OnLastStage()
"""What a pipeline stage other than the last passes as ``reference`` when the last stage
passes its kept reference: every stage then skips the reference forward together."""


class KeepsReferences(Protocol):
    """What ``ReferenceCollector`` asks of the controller."""

    def as_reference(self, out: ProbeOutput) -> Any: ...


class ReferenceCollector:
    """Keeps the probe rows' reference at θ (and the held-out rows' when ``kl/realized`` is
    due) from the *training* forward of a mini-batch, so that
    ``step`` needs no forward of its own for them.

    ``wrap`` a loss function ``loss_fn(micro_batch, last_hidden)``: it runs on the last
    pipeline stage for each micro-batch in order and keeps, of the rows among the first
    ``rows`` of the mini-batch, their logits (``logits``: the ``full`` estimator) or the
    token log-probs the loss computes (``k1``/``k2``/``k3``: only ``[rows, s]`` floats). The
    training forward is the same model at the same weights (no dropout in RL fine-tuning),
    so this is the reference the probe forward would compute.
    """

    def __init__(self, controller: KeepsReferences, rows: int, logits: bool = False):
        self.controller, self.rows, self.logits = controller, rows, logits
        self._seen, self._parts = 0, []

    def wrap(self, loss_fn):
        def keeping(batch, out: LastHidden):
            rows = batch["tokens"].shape[0]
            index = batch.get(ROWS)  # length-grouped micro-batches: their rows' indices
            if index is None:
                index = torch.arange(self._seen, self._seen + rows)
            self._seen += rows
            take = (index < self.rows).to(out.hidden.device)
            if bool(take.any()):  # the probe forward's length: the schedule's padding cut off
                seq = unpadded_length(batch)
                if self.logits:
                    with torch.no_grad():
                        values = out.logits()
                else:  # the loss's own log-probs (computed once, with their graph)
                    values = out.log_probs()
                kept = self.controller.as_reference(
                    ProbeOutput(
                        values.detach()[take, :seq],
                        batch["tokens"][take, 1 : seq + 1],
                        batch["mask"][take, :seq],
                    )
                )
                self._parts.append((index[take.to(index.device)], kept))
            return loss_fn(batch, out)

        return keeping

    def result(self):
        """The reference of the probe rows in row order (last stage; zeros past a row's
        micro-batch width), ``REFERENCE_ON_LAST_STAGE`` elsewhere."""
        if not self._parts:
            return REFERENCE_ON_LAST_STAGE
        index = [i for i, _ in self._parts]
        rows = sum(len(i) for i in index)
        return ProbeOutput(
            *(
                scatter_rows([getattr(p, f) for _, p in self._parts], index, rows)
                for f in ("logits", "targets", "mask")
            )
        )


def gpt_probe_forward(
    model, micro_batch_size: int | None = None, log_probs: bool = False, group: bool = True
):
    """The probe forward of a (DDP-wrapped) Megatron-Core ``GPTModel`` through Megatron's
    forward-only schedule (``loggra_megatron.model.forward.forward_map``), so it works
    under PP. The batch is ``(tokens [b, s+1], mask [b, s] or None)``, run in micro-batches
    of ``micro_batch_size`` rows (default: all), grouped by length (``group``: rows of
    similar length share a micro-batch cut to its longest row; the outputs are 0 past it).
    ``log_probs``: return the sampled tokens' log-probs ``[b, s]`` (the k-estimators,
    computed in token chunks) instead of the logits (``full``)."""
    from loggra_megatron.model.forward import forward_map

    def forward(batch) -> ProbeOutput | None:
        tokens, mask = batch
        rows, seq = tokens.shape[0], tokens.shape[1] - 1
        mbs = min(micro_batch_size or rows, rows)
        padded = tokens.new_zeros(-(-rows // mbs) * mbs, seq + 1)  # equal micro-batches (PP)
        padded[:rows] = tokens
        lengths = torch.ones(len(padded), dtype=torch.long, device=tokens.device)
        lengths[:rows] = seq if mask is None else needed_lengths(mask)
        micro = micro_batches({"tokens": padded}, mbs, lengths, group)

        def keep(b, out: LastHidden):  # the schedule may pad the length (FP8, SP): cut back
            return (out.log_probs() if log_probs else out.logits())[:, : unpadded_length(b)]

        out = forward_map(model, micro, keep)
        if out is None:
            return None
        out = scatter_rows(out, row_indices(micro), len(padded), seq)[:rows]
        targets = tokens[:, 1:]
        mask = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask
        return ProbeOutput(out, targets, mask)

    return forward


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [b, s, ...]`` with zeros appended along ``s`` up to ``width``."""
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], extra, *x.shape[2:]))], dim=1)


def cat_batches(a, b):
    """The rows of two batches of the probe forward as one batch: tensors are concatenated
    along their first dimension, tuples element by element (``None`` stays ``None``)."""
    if a is None and b is None:
        return None
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b])
    return tuple(cat_batches(x, y) for x, y in zip(a, b, strict=True))


def batch_rows(batch, rows: slice):
    """Rows ``rows`` of a batch of the probe forward (tensors and tuples of them)."""
    if batch is None:
        return None
    if isinstance(batch, torch.Tensor):
        return batch[rows]
    return tuple(batch_rows(x, rows) for x in batch)


def num_rows(batch) -> int:
    return batch.shape[0] if isinstance(batch, torch.Tensor) else num_rows(batch[0])


def cat_outputs(a: ProbeOutput | None, b: ProbeOutput | None) -> ProbeOutput | None:
    if a is None:  # a pipeline stage other than the last
        return None
    return ProbeOutput(
        *(torch.cat([getattr(a, f), getattr(b, f)]) for f in ("logits", "targets", "mask"))
    )


def widen_output(out: ProbeOutput, width: int) -> ProbeOutput:
    return ProbeOutput(*(_widen(getattr(out, f), width) for f in ("logits", "targets", "mask")))


def output_rows(out: ProbeOutput, rows: slice) -> ProbeOutput:
    return ProbeOutput(out.logits[rows], out.targets[rows], out.mask[rows])


def nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, ProbeOutput):
        return nbytes(x.logits)
    return x.numel() * x.element_size()
