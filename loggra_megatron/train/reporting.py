"""What an RL step reports: per-rank metrics reduced over pipeline stages and DP ranks as
declared (``metric_keys``), memory figures, and the warning when LoGRA's
sketch keeps too little of the gradient (``EnergyWatch``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from loggra_megatron.metric_keys import MAX, MEAN, METRICS, MIN, SUM, declared


def reduce_metrics(
    local: dict[str, float],
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup,
    device: torch.device,
) -> dict[str, float]:
    """Each key's declared reduction over the DP ranks (``mean`` or ``sum``) of its mean over
    the pipeline stages that have it (the loss terms live on the last stage), or (``max``,
    ``min``) the largest or smallest value of any rank of both groups. Every rank joins with
    every key declared to be reduced over ranks, whether or not it has a value; keys no rank
    has are left out. Collective over both groups, on ``device`` (NCCL takes no host
    tensors)."""
    for key in local:
        declared(key, "ranks")
    reduced = _averaged(local, pp_group, dp_group, device)
    reduced.update(_extremes(local, pp_group, dp_group, device))
    return reduced


def _averaged(local, pp_group, dp_group, device) -> dict[str, float]:
    """The keys declared ``mean`` or ``sum`` over ranks (``reduce_metrics``)."""
    keys = sorted(k for k, m in METRICS.items() if m.reduction.ranks in (MEAN, SUM))
    values = [float(local.get(k, 0.0)) for k in keys]
    present = [float(k in local) for k in keys]
    stacked = torch.tensor([values, present], dtype=torch.float64, device=device)
    for group in (pp_group, dp_group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(stacked, group=group)
    stacked = stacked.cpu()
    dp = dist.get_world_size(dp_group)
    reduced = {}
    for i, key in enumerate(keys):
        if stacked[1, i] > 0:
            mean = float(stacked[0, i] / stacked[1, i])
            reduced[key] = mean * dp if METRICS[key].reduction.ranks == SUM else mean
    return reduced


def _extremes(local, pp_group, dp_group, device) -> dict[str, float]:
    """The keys declared ``max`` or ``min`` over ranks, in one ``MAX`` all-reduce (a ``min``
    as the max of its negation; −inf: the rank has no value)."""
    sign = {
        k: 1.0 if m.reduction.ranks == MAX else -1.0
        for k, m in sorted(METRICS.items())
        if m.reduction.ranks in (MAX, MIN)
    }
    values = [sign[k] * float(local[k]) if k in local else -math.inf for k in sign]
    extreme = torch.tensor(values, dtype=torch.float64, device=device)
    for group in (pp_group, dp_group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(extreme, op=dist.ReduceOp.MAX, group=group)
    return {
        k: sign[k] * v for k, v in zip(sign, extreme.cpu().tolist(), strict=True) if v > -math.inf
    }


def memory_metrics(optimizer, model_chunks) -> dict[str, float]:
    """Optimizer state bytes (exact), the bytes of the DDP grad buffers and of the backward
    sketch's buffer (the step's peaks: ``train.memory_phases``)."""
    from loggra_megatron.optim import state_bytes
    from loggra_megatron.optim.megatron.backward_optimizer import sketch_sites_of

    buffers = [b for c in model_chunks for b in [*c.buffers, *c.expert_parallel_buffers]]
    sites = sketch_sites_of(optimizer)
    return {
        "memory/optimizer_state_bytes": float(state_bytes(optimizer)),
        "memory/grad_buffer_bytes": float(sum(_nbytes(b.grad_data) for b in buffers)),
        "memory/sketch_buffer_bytes": float(sum(_nbytes(s.buffer) for s in sites)),
    }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


ENERGY_WARN_STEPS = 10
"""Consecutive RL steps below the threshold before ``EnergyWatch`` warns."""


class EnergyWatch:
    """Warns once per run when a weight family's captured energy
    (``loggra/captured_energy/<family>/mean``) stays below ``threshold`` for
    ``patience`` consecutive RL steps that report it (0: never); the threshold and why:
    docs/optimizer.md#captured-energy."""

    def __init__(self, threshold: float, patience: int = ENERGY_WARN_STEPS):
        self.threshold, self.patience = threshold, patience
        self.below: dict[str, int] = {}
        """Consecutive steps below the threshold, by family."""
        self.warned = False

    def update(self, metrics: dict[str, float]) -> str | None:
        """The warning, the first time a family has been low for ``patience`` steps."""
        if self.warned or self.threshold <= 0:
            return None
        prefix, suffix = "loggra/captured_energy/", "/mean"
        for key, value in metrics.items():
            if key.startswith(prefix) and key.endswith(suffix):
                family = key[len(prefix) : -len(suffix)]
                self.below[family] = self.below.get(family, 0) + 1 if value < self.threshold else 0
        low = sorted(f for f, n in self.below.items() if n >= self.patience)
        if not low:
            return None
        self.warned = True
        shares = ", ".join(f"{f} {metrics[prefix + f + suffix]:.2f}" for f in low)
        return (
            f"LoGRA's sketch has kept less than {self.threshold:g} of the gradient energy of "
            f"{', '.join(low)} for {self.patience} RL steps (now {shares}): runs that kept this "
            "little lost reward against the dense AdamW update in every seed of the rank sweep "
            "(docs/optimizer.md#captured-energy); raise --loggra-rank (a basis refresh lifts "
            "it for one step only)"
        )
