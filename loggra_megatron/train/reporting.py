"""What an RL step reports: per-rank metrics reduced over pipeline stages and DP ranks,
and memory figures."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

REDUCED_KEYS = (
    "loss/total", "loss/policy", "loss/kl_ref", "kl/ref", "clip/fraction", "ratio/mean",
    "reward/mean", "reward/std", "reward/accuracy", "response/length_mean",
)  # fmt: skip
"""Keys every rank joins the reduction of, even where it has no value (PP stages)."""


def reduce_metrics(local: dict[str, float], pp_group, dp_group, device) -> dict[str, float]:
    """Means over DP of the per-rank metrics; the loss terms live on the last PP stage and
    are summed over PP (other stages contribute zeros). Collective over both groups, on
    ``device`` (NCCL takes no host tensors)."""
    keys = set(REDUCED_KEYS) | set(local)
    if dist.get_world_size(pp_group) > 1:  # the loss keys exist on the last stage only
        gathered = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, sorted(keys), group=pp_group)
        keys = set().union(*gathered)
    keys = sorted(keys)
    stacked = torch.tensor([[float(local.get(k, 0.0)) for k in keys],
                            [float(k in local) for k in keys]], dtype=torch.float64, device=device)  # fmt: skip
    for group in (pp_group, dp_group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(stacked, group=group)
    stacked = stacked.cpu()
    return {
        k: float(stacked[0, i] / stacked[1, i]) for i, k in enumerate(keys) if stacked[1, i] > 0
    }


def memory_metrics(optimizer, device) -> dict[str, float]:
    """Optimizer state bytes (exact) and the peak memory so far of this rank."""
    from loggra_megatron.optim import state_bytes

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:  # CPU: the process's peak resident set size (KiB on Linux)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "memory/optimizer_state_bytes": float(state_bytes(optimizer)),
        "memory/peak_bytes": float(peak),
    }
