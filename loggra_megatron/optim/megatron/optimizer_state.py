"""A Megatron optimizer's state: its leaves, its size, and ``dist_checkpointing`` (request,
compatibility, load).

``checkpointing/dist_ckpt.py`` saves and loads whole checkpoints; what it needs to know of
Megatron's optimizer classes is here:

* the leaf optimizers of a ``ChainedOptimizer`` (``leaf_optimizers``) and the bytes of
  their inner optimizers' state (``state_bytes``);
* Megatron's dense ``DistributedOptimizer`` in its ``dp_reshardable`` format, its padding
  entries zeroed on save and load;
* the state a load needs before the first step (``allocate_state``,
  ``install_state_init``);
* LoGRA's leaves (``LoGRACheckpointMixin``),
  which allocate and check their own state.

Padding, state allocation per optimizer class: docs/checkpointing.md#the-optimizers-state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from loggra_megatron.optim.gradient_sketch import adamw
from loggra_megatron.optim.megatron.checkpoint import LoGRACheckpointMixin

DENSE_OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
"""Megatron's dense DistributedOptimizer format. megatron-core 0.16's own default cannot be
saved."""


def leaf_optimizers(optimizer) -> list:
    """The optimizers a (possibly chained) Megatron optimizer is made of."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def state_bytes(optimizer) -> int:
    """Exact bytes of optimizer state on this rank: every tensor in the state of a torch
    optimizer, or of the inner optimizers of a Megatron-Core optimizer (a ``ChainedOptimizer``
    or a leaf; their fp32 main params are not optimizer state)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return adamw.state_bytes(optimizer)
    inners = (getattr(leaf, "optimizer", None) for leaf in leaf_optimizers(optimizer))
    return sum(adamw.state_bytes(inner) for inner in inners if inner is not None)


def install_state_init(optimizer, init_state: Callable) -> None:
    """Make ``init_state(inner, config=None)`` every leaf's ``init_state_fn``: the hook
    Megatron's ``Float16``/``FP32`` optimizers call to allocate their inner optimizer's state
    before a checkpoint is loaded into it (Megatron sets it for Adam only)."""
    for leaf in leaf_optimizers(optimizer):
        leaf.init_state_fn = init_state


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
def allocate_state(leaf) -> None:
    """Give ``leaf``'s inner optimizer the state a checkpoint is loaded into, before its first
    step. LoGRA's leaves allocate their own; Megatron's ``Float16``/``FP32`` optimizers call
    their ``init_state_fn`` in ``sharded_state_dict`` (refused here if there is none); the
    ``DistributedOptimizer`` takes Megatron's dummy step (zero grads, one inner step), at lr 0
    so that no parameter changes."""
    inner = getattr(leaf, "optimizer", None)
    if inner is None or len(inner.state) or isinstance(leaf, LoGRACheckpointMixin):
        return
    if hasattr(inner, "init_state_of"):  # allocates its state in sharded_state_dict
        return
    if not isinstance(leaf, DistributedOptimizer):
        if getattr(leaf, "init_state_fn", None) is None:
            raise ValueError(
                f"{type(inner).__name__} has no state initialisation for loading a checkpoint: "
                "give its --optimizer registry entry an init_state (optim/registry.py)"
            )
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
            allocate_state(leaf)
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
                f"checkpoint {path} holds LoGRA optimizer state but this run's optimizer is "
                "not LoGRA: resume with --optimizer loggra, or load the weights only with "
                "--no-load-optim"
            )


@torch.no_grad()
def load_state(optimizer, loaded: list) -> None:
    """Copy what ``dist_checkpointing.load`` returned for ``sharded_state_dict`` into
    the live optimizer."""
    for leaf, leaf_state in zip(leaf_optimizers(optimizer), loaded, strict=True):
        leaf.load_state_dict(leaf_state)
        _restore_per_param_step(leaf, leaf_state)


def _restore_per_param_step(leaf, leaf_state) -> None:
    """Megatron's dense DistributedOptimizer keeps the inner optimizer's step (torch AdamW's
    per-param ``step``: CPU, no TE/apex) in the saved param groups, but ``dp_reshardable``
    then copies every param's placeholder step over it; set each param's step from the param
    groups, as a tensor of its own."""
    inner = getattr(leaf, "optimizer", None)
    groups = leaf_state.get("optimizer", {}).get("param_groups", [])
    steps = {g["step"] for g in groups if "step" in g}
    if not isinstance(leaf, DistributedOptimizer) or inner is None or len(steps) != 1:
        return
    (step,) = steps
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = torch.tensor(float(step))
