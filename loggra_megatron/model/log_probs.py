"""Log-probs of given sequences under the policy: a forward-only pass through Megatron's
schedule, in micro-batches grouped by length (the behaviour, reference and old-policy
log-probs of an RL step; the rollout engines' sampled log-probs are the same arithmetic,
``docs/rollouts.md#the-static-engine``)."""

from __future__ import annotations

import torch

from loggra_megatron.model.batching import (
    PaddingStats,
    micro_batches,
    row_indices,
    scatter_rows,
)
from loggra_megatron.model.forward import forward_map, unpadded_length

__all__ = ["compute_log_probs"]


@torch.no_grad()
def compute_log_probs(
    model,
    tokens: torch.Tensor,
    *,
    micro_batch_size: int | None = None,
    lengths: torch.Tensor | None = None,
    group: bool = True,
    padding: PaddingStats | None = None,
) -> torch.Tensor | None:
    """``log π(tokens[:, t + 1] | tokens[:, :t + 1])`` as ``[B, L - 1]`` float32.

    A no-cache, no-grad, eval-mode forward of ``tokens [B, L]`` (log-probs in token chunks,
    ``model.output_head``) in micro-batches of
    ``micro_batch_size`` (default: the whole batch) through Megatron's forward-only schedule.
    Right padding is harmless (causal attention); mask the result with the rollout's
    ``response_mask``. ``lengths [B]``: the positions each row needs (e.g. up to its last
    response target); with ``group`` rows of similar length then share a micro-batch cut to
    its longest row (``micro_batches``; log-probs past
    that width are 0). ``padding`` counts the slots fed (real: within
    ``lengths``). Returns the log-probs on the last
    pipeline stage, ``None`` on others.
    """
    device = next(model.parameters()).device
    tokens = tokens.to(device=device, dtype=torch.long)
    batch, length = tokens.shape
    if length < 2:
        raise ValueError("need sequences of length >= 2")
    mbs = min(micro_batch_size or batch, batch)
    num_micro = -(-batch // mbs)
    padded = tokens.new_zeros(num_micro * mbs, length)  # the schedule pads the length
    padded[:batch] = tokens
    needed = torch.full((len(padded),), length - 1, dtype=torch.long, device=device)
    if lengths is not None:
        needed[batch:] = 1  # rows that fill the last micro-batch (PP: equal micro-batches)
        needed[:batch] = lengths.to(device).clamp(1, length - 1)
    micro = micro_batches({"tokens": padded}, mbs, needed, group and lengths is not None)

    def log_probs(b, out):  # the schedule may pad the length (FP8, SP): cut back
        return out.log_probs()[:, : unpadded_length(b)]

    out = forward_map(model, micro, log_probs, padding)
    if out is None:
        return None
    out = scatter_rows(out, row_indices(micro), len(padded), length - 1)
    return out[:batch, : length - 1].contiguous()
