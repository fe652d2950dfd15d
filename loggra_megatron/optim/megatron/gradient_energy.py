"""What the sketch keeps: the share ``‖G Q‖² / ‖G‖²`` of each weight's gradient energy that
LoGRA's sketch ``S = G Q`` retains, per weight family and transformer layer.

Every committed step of a ``ShardedLoGRAAdamW``
records this rank's ``(‖S‖², ‖G‖²)`` per slot ``4·global layer + family`` from norms the
step already has (its ``energy``, ``EnergyLog``). ``captured_energy`` sums the records of an RL
step's updates over all ranks in one all-reduce of ``[updates, slots, 2]`` float64 (DP
slices, TP shards and pipeline stages partition the weights; a replicated weight is counted
alike in both terms) and reports, per family, the mean and the min over layers of each
layer's ratio averaged over the step's updates. Definition and reading:
docs/optimizer.md#captured-energy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FAMILIES = ("qkv", "proj", "fc1", "fc2")
"""Weight families, in slot order: ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``."""


def family_of(name: str) -> str | None:
    """The family of a parameter named ``...linear_<family>.weight`` (None: another)."""
    for family in FAMILIES:
        if name.endswith(f"linear_{family}.weight"):
            return family
    return None


def energy_slots_of(model_chunks) -> tuple[dict, int]:
    """``({param: slot}, number of slots)``: slot ``4·(global layer) + family`` of each
    transformer-layer weight of a known family (Megatron's 1-based global ``layer_number``,
    so pipeline stages and virtual chunks agree), ``4·num_layers`` slots."""
    slots = {}
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            number = getattr(module, "layer_number", None)
            parts = name.split(".")
            if not isinstance(number, int) or len(parts) < 2 or parts[-2] != "layers":
                continue
            for param_name, p in module.named_parameters():
                family = family_of(param_name)
                if family is not None:
                    slots[p] = 4 * (number - 1) + FAMILIES.index(family)
    return slots, 4 * model_chunks[0].config.num_layers


def _recorders(optimizer) -> list:
    """The inner optimizers of ``optimizer``'s leaves that record captured energy."""
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = [getattr(leaf, "optimizer", None) for leaf in leaves]
    return [o for o in inner if getattr(getattr(o, "energy", None), "slots", 0)]


def discard_captured_energy(optimizer) -> None:
    """Forget the records so far (e.g. the warm-up's, before an RL step)."""
    for recorder in _recorders(optimizer):
        recorder.energy.records.clear()


def captured_energy(optimizer, max_updates: int, device, group=None) -> dict[str, float]:
    """``loggra/captured_energy/<family>/{mean,min}`` of the updates recorded since the last
    call (at most ``max_updates``, the RL step's), and the records cleared. Collective over
    ``group`` (None: the world) whenever ``optimizer`` records at all; every rank must hold
    the same number of committed updates (skips are decided alike on every rank). Empty for
    an optimizer that records nothing."""
    recorders = _recorders(optimizer)
    if not recorders:
        return {}
    total = torch.zeros(max_updates, recorders[0].energy.slots, 2, dtype=torch.float64)
    total = total.to(device)
    for recorder in recorders:
        records = list(recorder.energy.records)[-max_updates:]
        for u, record in enumerate(records):
            total[u] += record.to(device)
        recorder.energy.records.clear()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return energy_metrics(total.cpu())


def energy_metrics(total: torch.Tensor) -> dict[str, float]:
    """The keys from global ``[updates, slots, 2]`` sums ``(‖G Q‖², ‖G‖²)``: each slot's
    ratio averaged over the updates where its gradient is non-zero, then per family the mean
    and the min over the layers that have one (no key for a family without any)."""
    captured, energy = total[..., 0], total[..., 1]
    present = energy > 0
    ratio = torch.where(present, captured / energy.clamp_min(1e-300), torch.zeros_like(energy))
    counts = present.sum(0)
    per_slot = ratio.sum(0) / counts.clamp_min(1)
    per_slot, has = per_slot.view(-1, len(FAMILIES)), (counts > 0).view(-1, len(FAMILIES))
    metrics = {}
    for f, family in enumerate(FAMILIES):
        values = per_slot[has[:, f], f]
        if len(values):
            metrics[f"loggra/captured_energy/{family}/mean"] = float(values.mean())
            metrics[f"loggra/captured_energy/{family}/min"] = float(values.min())
    return metrics
