"""Trainer checkpoints: on-disk layout and resume selection (``.layout``, no process
group needed), integrity checks (``.integrity``) and Megatron ``dist_checkpointing``
save/load of model + optimizer (``.dist_ckpt``)."""

from loggra_megatron.checkpointing.layout import (
    CheckpointError,
    CheckpointRef,
    checkpoint_dir,
    has_checkpoint,
    latest_iteration,
    select_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointRef",
    "checkpoint_dir",
    "has_checkpoint",
    "latest_iteration",
    "load_checkpoint",
    "save_checkpoint",
    "select_checkpoint",
]


def __getattr__(name):  # the dist_checkpointing half imports megatron-core; load it on use
    if name in ("save_checkpoint", "load_checkpoint"):
        from loggra_megatron.checkpointing import dist_ckpt

        return getattr(dist_ckpt, name)
    raise AttributeError(f"module 'loggra_megatron.checkpointing' has no attribute {name!r}")
