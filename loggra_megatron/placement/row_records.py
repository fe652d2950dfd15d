"""The trainer's side of the low-rank weight sync: what the backward sketch's optimizer
committed since the last sync, and its masters, as ``placement.lowrank`` records (CPU), read
from the ``BackwardSketchOptimizer`` leaf (``optim.megatron.backward_optimizer``) of this rank:
its own rows of each sketched weight (its DP segment, its TP shard)."""

from __future__ import annotations

import torch

from loggra_megatron.placement.lowrank import RowMaster, RowUpdate

__all__ = ["sketch_leaf", "start_recording", "take_row_updates", "row_masters"]


def sketch_leaf(optimizer):
    """The ``BackwardSketchOptimizer`` among ``optimizer``'s leaves (None: there is none)."""
    from loggra_megatron.optim.megatron.backward_optimizer import BackwardSketchOptimizer

    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    return next((leaf for leaf in leaves if isinstance(leaf, BackwardSketchOptimizer)), None)


def start_recording(leaf) -> None:
    """From now on, RowAdam keeps every committed update (``RowAdam.recorded``)."""
    leaf.optimizer.recorded = []


def _names(leaf) -> dict[int, str]:
    """``{id(weight): Megatron name of the whole model}`` of the model chunk's parameters
    (a pipeline stage's layer indices made global)."""
    from megatron.core.utils import unwrap_model

    from loggra_megatron.convert.hf_to_megatron import layer_offset
    from loggra_megatron.convert.mapping import global_name

    chunk = unwrap_model(leaf.model_chunks[0])
    offset = layer_offset(chunk)
    return {id(p): global_name(name, offset) for name, p in chunk.named_parameters()}


def take_row_updates(leaf, tp_rank: int) -> list[RowUpdate]:
    """The updates committed since the last call, in order (and forgets them)."""
    names, recorded = _names(leaf), leaf.optimizer.recorded
    leaf.optimizer.recorded = []
    out = []
    for p, direction, rate, weight_decay, steps in recorded:
        sites, site, lo, hi = leaf.rows_of[p]
        out.append(
            RowUpdate(
                name=names[id(site.weight)],
                tp_rank=tp_rank,
                lo=lo,
                hi=hi,
                direction=direction.detach().to("cpu", torch.float32, copy=True),
                rate=float(rate),
                weight_decay=float(weight_decay),
                site=site.name,
                kind=sites.kind,
                seed=sites.seed,
                draw=steps // sites.refresh_interval,
                rank=sites.rank,
                full_cols=site.full_cols,
                col_offset=site.col_offset,
                cols=site.cols,
            )
        )
    return out


def row_masters(leaf, tp_rank: int) -> list[RowMaster]:
    """This rank's fp32 masters of its rows of every sketched weight."""
    names, inner = _names(leaf), leaf.optimizer
    out = []
    for main, (_, site, lo, hi) in leaf.rows_of.items():
        if site.weight.dtype == torch.float32:
            storage = "weight"
        else:
            storage = "remainder" if main in inner.param_remainders else "master"
        master = inner.master_of(main).detach().to("cpu", torch.float32, copy=True)
        out.append(RowMaster(names[id(site.weight)], tp_rank, lo, hi, master, storage))
    return out
