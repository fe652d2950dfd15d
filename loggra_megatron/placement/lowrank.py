"""The low-rank weight sync (``--weight-sync lowrank``): each sketched weight's update travels
as the rows' factor ``D`` and the projection's draw, and the generation side repeats the
trainer's arithmetic on a copy of the trainer's masters, bit for bit.

The backward sketch commits, for the rows ``W[lo:hi]`` a data-parallel rank owns of a
sketched weight (``optim.backward_sketch.row_adam``)::

    master ← (1 − rate·λ)·master − rate · D · A        D: [hi − lo, r] fp32, A = B / √r

where ``B`` is drawn from ``(--loggra-seed, draw index, layer)``
(``optim.backward_sketch.sketch.draw_signs``), and the model weight is then the master rounded to
the model's dtype (or, with ``--loggra-param-remainders``, the master's upper half). So the
trainer sends ``(D, rate, λ, draw)`` per row block, ``r/n`` of a full sync's bytes for that
block (``4·r`` bytes per row against ``2·n``), and ``TargetShadow`` repeats ``row_target``
(the one function both sides call) on the same row blocks, on the same kind of device,
from a copy of the same masters: the same GEMM shapes give the same bits.

A shadow is per sketched weight and training TP rank, in the trainer's layout: the model
weight, and its fp32 master (a ``--bf16`` run's) or int16 remainder
(``--loggra-param-remainders``); an fp32 run's weight is its master. Its memory is the
generation side's cost of the low-rank sync: per sketched parameter, the weight in the
training layout (2 bytes in bf16) and the master (4 bytes, or 2 with remainders).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loggra_megatron.optim.backward_sketch.row_adam import row_target
from loggra_megatron.optim.backward_sketch.sketch import draw_signs
from loggra_megatron.optim.param_remainders import join_master, store_master

__all__ = ["RowMaster", "RowUpdate", "Shadows", "TargetShadow", "apply_row_updates"]


@dataclass
class RowUpdate:
    """One committed update of the rows ``[lo, hi)`` of sketched weight ``name`` on training
    TP rank ``tp_rank`` (CPU tensors), and the projection it was drawn with."""

    name: str
    tp_rank: int
    lo: int
    hi: int
    direction: torch.Tensor
    rate: float
    weight_decay: float
    site: str
    """The projection's layer key (``SketchSite.name``)."""
    kind: str
    seed: int
    draw: int
    rank: int
    full_cols: int
    col_offset: int
    cols: int

    def signs(self, device, dtype) -> torch.Tensor:
        """``B`` of this update, this TP rank's columns, as the trainer drew it."""
        full = draw_signs(
            self.kind, self.seed, self.draw, self.site, self.rank, self.full_cols, device, dtype
        )
        return full[:, self.col_offset : self.col_offset + self.cols]

    @property
    def nbytes(self) -> int:
        return self.direction.numel() * self.direction.element_size()


@dataclass
class RowMaster:
    """The fp32 master of rows ``[lo, hi)`` of sketched weight ``name`` on training TP rank
    ``tp_rank`` (CPU), and how the trainer stores it: ``"weight"`` (an fp32 model: the
    weight is the master), ``"master"`` (a separate fp32 master) or ``"remainder"``."""

    name: str
    tp_rank: int
    lo: int
    hi: int
    master: torch.Tensor
    storage: str


class TargetShadow:
    """The trainer's copy of one sketched weight on one training TP rank: ``weight`` (the
    model dtype, ``[m, n]``) and its master storage (module docstring)."""

    def __init__(self, weight: torch.Tensor, storage: str):
        self.weight, self.storage = weight, storage
        self.master = weight.float() if storage == "master" else None
        self.remainder = (
            torch.zeros_like(weight, dtype=torch.int16) if storage == "remainder" else None
        )

    def set_master(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """Rows ``[lo, hi)`` take the trainer's master (the first sync; the weight is the
        trainer's already, and with remainders the master's upper half by construction)."""
        master = master.to(self.weight.device, torch.float32).contiguous()
        if self.master is not None:
            self.master[lo:hi].copy_(master)
        else:
            self._store(lo, hi, master)

    def master_rows(self, lo: int, hi: int) -> torch.Tensor:
        if self.remainder is not None:
            return join_master(self.weight[lo:hi], self.remainder[lo:hi])
        return self.weight[lo:hi] if self.master is None else self.master[lo:hi]

    def apply(self, update: RowUpdate) -> None:
        """Repeat the trainer's commit of ``update`` on its rows."""
        device = self.weight.device
        signs = update.signs(device, self.weight.dtype)
        direction = update.direction.to(device)
        master = self.master_rows(update.lo, update.hi)
        target = row_target(master, update.rate, update.weight_decay, direction, signs)
        self._store(update.lo, update.hi, target)

    def _store(self, lo: int, hi: int, target: torch.Tensor) -> None:
        """The trainer's write of a new master: ``store_master`` with remainders, else the
        master and then the weight rounded from it (``rows.copy_(main)``)."""
        if self.remainder is not None:
            store_master(self.weight[lo:hi], self.remainder[lo:hi], target)
        elif self.master is not None:
            self.master[lo:hi].copy_(target)
            self.weight[lo:hi].copy_(self.master[lo:hi])
        else:
            self.weight[lo:hi].copy_(target)


def apply_row_updates(shadows: dict, updates: list[RowUpdate]) -> set[str]:
    """Each update, in the order the trainer committed them, on ``shadows[(name, tp_rank)]``;
    the names of the weights they changed."""
    for update in updates:
        shadows[(update.name, update.tp_rank)].apply(update)
    return {u.name for u in updates}


class Shadows:
    """The generation side's ``TargetShadow`` of the sketched weights, made from the first
    sync and advanced by the row updates of every later one.

    When the generation TP size is the training one (``local``: this rank's unwrapped model
    and TP rank), a rank's shards are laid out as the trainer's TP rank of the same index:
    it keeps only those, and their weight is the model's own parameter, so an update lands
    in the model directly and the copy costs the masters alone. Otherwise every rank keeps
    every shard in the trainer's layout and returns the changed weights as Hugging Face
    tensors, to be resharded."""

    def __init__(self, model_args, training_tp: int, device, local=None):
        self.args, self.training_tp, self.device = model_args, training_tp, device
        self.local = local
        self.shadows: dict[tuple[str, int], TargetShadow] = {}

    def start(self, tensors: dict[str, torch.Tensor], masters: list[RowMaster]) -> None:
        """Each sketched weight's shards with the trainer's masters: this rank's parameters
        (``local``; loaded from the sync already), or cut from the sync's Hugging Face
        ``tensors`` in the trainer's layout."""
        from loggra_megatron.convert.mapping import megatron_local_from_hf, param_mapping
        from loggra_megatron.placement.weights import TensorDict

        self.shadows.clear()
        src = TensorDict(tensors)
        params = dict(self.local[0].named_parameters()) if self.local else {}
        for m in masters:
            key = (m.name, m.tp_rank)
            if self.local and m.tp_rank != self.local[1]:
                continue
            if key not in self.shadows:
                if self.local:
                    weight = params[m.name].data
                else:
                    mapping = param_mapping(m.name, self.args)
                    shard = megatron_local_from_hf(
                        mapping, src, self.args, m.tp_rank, self.training_tp
                    )
                    weight = shard.to(self.device).clone()
                self.shadows[key] = TargetShadow(weight, m.storage)
            self.shadows[key].set_master(m.lo, m.hi, m.master)

    def advance(self, updates: list[RowUpdate]) -> dict[str, torch.Tensor]:
        """Apply ``updates``; the Hugging Face tensors of the weights they changed (CPU;
        none with ``local``: the model's parameters changed in place)."""
        from loggra_megatron.convert.mapping import hf_tensors_from_megatron, param_mapping

        if self.local:
            apply_row_updates(self.shadows, [u for u in updates if u.tp_rank == self.local[1]])
            return {}
        out = {}
        for name in sorted(apply_row_updates(self.shadows, updates)):
            shards = [self.shadows[(name, t)].weight.cpu() for t in range(self.training_tp)]
            out.update(hf_tensors_from_megatron(param_mapping(name, self.args), shards, self.args))
        return out
