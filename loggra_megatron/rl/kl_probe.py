"""What predicted-KL control measures with: the probe forward, the reference, the KL.

``gpt_probe_forward`` runs a batch of probe rows through Megatron's forward-only schedule
(so it works under PP), grouped by length like the training forward, and returns a
``ProbeOutput`` on the last pipeline stage: the vocab-parallel logits (``full``
estimator) or the sampled tokens' log-probs (``k1``/``k2``/``k3``), the targets and the mask.
``ReferenceCollector`` keeps the same output at θ from the *training* forward of a
mini-batch, so that the controller needs no reference forward of its own.
``ProbeKL`` measures the mean per-token ``KL(π_ref ‖ π_current)`` of a batch:
forwards of ``forward_rows`` rows, the TP reductions of ``model.vocab_parallel``, then one
all-reduce of ``[Σ KL, #tokens]`` per part over DP and one over PP (the other stages add
zeros), so that every rank and stage gets the same number. docs/kl_control.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loggra_megatron.model.batching import (
    ROWS,
    micro_batches,
    needed_lengths,
    row_indices,
    scatter_rows,
)
from loggra_megatron.model.forward import unpadded_length
from loggra_megatron.model.output_head import LastHidden
from loggra_megatron.model.vocab_parallel import (
    sampled_kl,
    vocab_parallel_kl,
    vocab_parallel_log_probs,
)

ProbeBatch = tuple[torch.Tensor, "torch.Tensor | None"]
"""``(tokens [b, s+1], mask [b, s] or None)``: rows the KL is measured on (None: every
position counts)."""


@dataclass
class ProbeOutput:
    """What the probe forward returns on the last pipeline stage."""

    logits: torch.Tensor
    """``[b, s, V/TP]`` vocab-parallel logits, or ``[b, s]`` log-probs of the targets."""
    targets: torch.Tensor
    """``[b, s]`` the tokens that were sampled at each position."""
    mask: torch.Tensor
    """``[b, s]`` which positions count (the response tokens)."""

    def rows(self, rows: slice) -> ProbeOutput:
        return ProbeOutput(self.logits[rows], self.targets[rows], self.mask[rows])

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * self.logits.element_size()


ProbeForward = Callable[[ProbeBatch], "ProbeOutput | None"]
"""Runs the (pipelined) forward of a batch; ``ProbeOutput`` on the last stage, else None."""


class ReferenceCollector:
    """Keeps π_θ of the first ``rows`` rows of a mini-batch from its training forward.

    ``wrap`` a loss function ``loss_fn(micro_batch, last_hidden)``: it runs on the last
    pipeline stage for each micro-batch in order and keeps, of the rows among the first
    ``rows``, their logits (``logits``: the ``full`` estimator) or the token log-probs the
    loss computes anyway (``k1``/``k2``/``k3``: only ``[rows, s]`` floats). The training
    forward is the same model at the same weights (no dropout in RL fine-tuning), so this is
    what the probe forward would compute.
    """

    def __init__(self, rows: int, logits: bool):
        self.rows, self.logits = rows, logits
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
                kept = ProbeOutput(
                    values.detach()[take, :seq],
                    batch["tokens"][take, 1 : seq + 1],
                    batch["mask"][take, :seq],
                )
                self._parts.append((index[take.to(index.device)], kept))
            return loss_fn(batch, out)

        return keeping

    def result(self, width: int) -> ProbeOutput | None:
        """The kept rows in row order, ``width`` positions (zeros past a row's micro-batch
        width); None on pipeline stages other than the last (the loss never ran there)."""
        if not self._parts:
            return None
        index = [i for i, _ in self._parts]
        return ProbeOutput(
            *(
                scatter_rows([getattr(p, f) for _, p in self._parts], index, self.rows, width)
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


class ProbeKL:
    """Mean per-token ``KL(π_ref ‖ π_current)`` of a batch (see module docstring).

    Args:
        forward: the probe forward (no grad) of the policy.
        estimator: ``full`` (the exact KL from the logits) or ``k1``/``k2``/``k3``
            (estimated from the sampled tokens' log-probs).
        tp_group, dp_group, pp_group: Megatron's process groups (None: size 1).
        device: where the all-reduced sums live.
        forward_rows: rows per call of ``forward`` (None: all at once), so that one call's
            logits and KL temporaries exist at a time (the ``full`` estimator's are
            ``rows × s × V/TP`` floats, several times over).
    """

    def __init__(
        self,
        forward: ProbeForward,
        estimator: str,
        *,
        tp_group=None,
        dp_group=None,
        pp_group=None,
        device: torch.device | None = None,
        forward_rows: int | None = None,
    ):
        self.forward, self.estimator, self.forward_rows = forward, estimator, forward_rows
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.device = device or torch.device("cpu")

    @torch.no_grad()
    def reference(self, batch: ProbeBatch) -> ProbeOutput | None:
        """π at the current weights on ``batch``, as the KL needs it."""
        return self.as_reference(self.forward(batch))

    def as_reference(self, out: ProbeOutput | None) -> ProbeOutput | None:
        """The logits (``full``), else the sampled tokens' log-probs ``[b, s]`` (an output
        that already holds them is kept)."""
        if out is None or self.estimator == "full" or out.logits.ndim == 2:
            return out
        logp = vocab_parallel_log_probs(out.logits, out.targets, self.tp_group)
        return ProbeOutput(logp, out.targets, out.mask)

    @torch.no_grad()
    def __call__(
        self, batch: ProbeBatch, ref: ProbeOutput | None, split: int | None = None
    ) -> tuple[float, float | None]:
        """KL of rows ``[:split]`` and of rows ``[split:]`` (None without ``split``) against
        ``ref`` (the same rows at the reference weights). Collective."""
        tokens, mask = batch
        rows = len(tokens)
        parts = [(0, rows)] if split is None else [(0, split), (split, rows)]
        totals = torch.zeros(2 * len(parts), device=self.device)
        step = self.forward_rows or rows
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            chunk = (tokens[lo:hi], None if mask is None else mask[lo:hi])
            out = self.forward(chunk)
            if out is None:  # a pipeline stage other than the last
                continue
            if self.estimator == "full":
                per_token = vocab_parallel_kl(ref.logits[lo:hi], out.logits, self.tp_group)
            else:
                logp = self.as_reference(out).logits  # [b, s] log-probs
                per_token = sampled_kl(ref.logits[lo:hi], logp, self.estimator)
            counted = out.mask.to(per_token.dtype)
            sums = []
            for start, stop in parts:  # the part's rows within this chunk
                r = slice(max(start, lo) - lo, max(min(stop, hi), lo) - lo)
                sums += [(per_token[r] * counted[r]).sum(), counted[r].sum()]
            totals += torch.stack(sums).to(totals.device)
        for group in (self.dp_group, self.pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
        kl = (totals[0::2] / totals[1::2].clamp_min(1)).tolist()
        return kl[0], (kl[1] if split is not None else None)
