"""A Megatron optimizer's state for ``dist_checkpointing``: request, compatibility, load.

``checkpointing/dist_ckpt.py`` saves and loads whole checkpoints; what it needs to know of
Megatron's optimizer classes is here:

* the leaf optimizers of a ``ChainedOptimizer``;
* Megatron's dense ``DistributedOptimizer`` in its ``dp_reshardable`` format (bucket-wise,
  reshardable over DP, Megatron-LM's default). Its buckets carry *padding* entries (the gaps
  between parameters, flagged ``padding``) whose tensors Megatron allocates with
  ``torch.empty`` and drops on load: they are zeroed here on save and on load, so the
  checkpoint's bytes are deterministic and the finite checks judge only real state
  (uninitialised memory can hold NaN bit patterns; megatron-core 0.16-0.19 alike);
* torch AdamW's state, which Megatron allocates only at the first step (a dummy step at
  lr 0 here, before a load) and whose per-parameter ``step`` the ``dp_reshardable`` load
  overwrites with a placeholder (restored from the saved param groups);
* LoGRA's leaves (:class:`~loggra_megatron.optim.megatron.checkpoint.LoGRACheckpointMixin`),
  which check their own compatibility.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

DENSE_OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
"""Megatron's dense DistributedOptimizer format. megatron-core 0.16's own default cannot be
saved."""


def leaf_optimizers(optimizer) -> list:
    """The optimizers a (possibly chained) Megatron optimizer is made of."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_padding(entry: dict) -> bool:
    flag = entry.get("padding", False)
    return bool(flag.obj if isinstance(flag, LocalNonpersistentObject) else flag)


@torch.no_grad()
def zero_padding(state) -> None:
    """Zero every tensor of the ``padding`` entries in a dense ``dp_reshardable`` optimizer
    state (a sharded request, or what ``dist_checkpointing.load`` returned for one)."""
    if isinstance(state, dict) and _is_padding(state):
        for value in state.values():
            data = value.data if isinstance(value, ShardedTensor) else value
            if torch.is_tensor(data):
                data.zero_()
    elif isinstance(state, dict):
        for value in state.values():
            zero_padding(value)
    elif isinstance(state, list | tuple):
        for value in state:
            zero_padding(value)


@torch.no_grad()
def _allocate_dense_state(leaf) -> None:
    """A fresh torch AdamW (no TE/apex) has no state until its first step, but Megatron's
    ``DistributedOptimizer.sharded_state_dict()`` needs it: allocate it as Megatron does
    (zero grads, one inner step) at lr 0, so no parameter changes."""
    inner = getattr(leaf, "optimizer", None)
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or len(inner.state):
        return
    if not hasattr(leaf, "_init_optimizer_states_with_dummy_values"):
        return
    lrs = [g["lr"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["lr"] = 0.0
    try:
        leaf._init_optimizer_states_with_dummy_values()
    finally:
        for g, lr in zip(inner.param_groups, lrs, strict=True):
            g["lr"] = lr


def sharded_state_dict(optimizer, model_sharded_state_dict: dict, is_loading: bool) -> list:
    """One sharded state dict per leaf optimizer (fresh buffers with ``is_loading``)."""
    leaves = leaf_optimizers(optimizer)
    if is_loading:
        for leaf in leaves:
            _allocate_dense_state(leaf)
    state = [
        leaf.sharded_state_dict(
            model_sharded_state_dict, is_loading=is_loading, metadata=DENSE_OPTIMIZER_SHARDING
        )
        for leaf in leaves
    ]
    zero_padding(state)
    return state


def check_compatible(optimizer, saved: list, path: str) -> None:
    """Raise ``ValueError`` if the optimizer state ``saved`` (the checkpoint's common state,
    one entry per leaf) cannot be loaded into ``optimizer``."""
    leaves = leaf_optimizers(optimizer)
    if len(saved) != len(leaves):
        raise ValueError(
            f"checkpoint {path} has {len(saved)} optimizer(s), this run has {len(leaves)}: "
            "the model's parameter groups differ"
        )
    for leaf, leaf_saved in zip(leaves, saved, strict=True):
        if hasattr(leaf, "check_compatible"):
            leaf.check_compatible(leaf_saved.get("loggra"))
        elif "loggra" in leaf_saved:
            raise ValueError(
                f"checkpoint {path} holds LoGRA optimizer state but this run uses Megatron's "
                "dense Adam: resume with --optimizer loggra, or load the weights only with "
                "--no-load-optim"
            )


@torch.no_grad()
def load_state(optimizer, loaded: list) -> None:
    """Copy what ``dist_checkpointing.load`` returned for :func:`sharded_state_dict` into
    the live optimizer."""
    for leaf, leaf_state in zip(leaf_optimizers(optimizer), loaded, strict=True):
        leaf.load_state_dict(leaf_state)
        _restore_torch_adam_step(leaf, leaf_state)


def _restore_torch_adam_step(leaf, leaf_state) -> None:
    """Megatron's dense DistributedOptimizer keeps torch AdamW's step (CPU, no TE/apex) in
    the saved param groups, but ``dp_reshardable`` then copies every param's placeholder
    step over it; set each param's step from the param groups, as a tensor of its own."""
    inner = getattr(leaf, "optimizer", None)
    groups = leaf_state.get("optimizer", {}).get("param_groups", [])
    steps = {g["step"] for g in groups if "step" in g}
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or len(steps) != 1:
        return
    (step,) = steps
    for state in inner.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step))
