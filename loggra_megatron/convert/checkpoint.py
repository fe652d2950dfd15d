# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Megatron-Core distributed checkpoints of a converted GPT model.

The layout is the one Megatron-LM's ``--load`` understands, iteration ``release``
(``DIR/release/`` in ``torch_dist`` format with its manifest, ``DIR/loggra_model_args.json``
with the architecture, ``DIR/hf_config.json`` with the original HF config). ``torch_dist``
stores *global* tensors (TP shards and PP stages are reassembled on save), so a checkpoint
saved at one TP/PP loads at any other that the architecture allows; the embedding/output
rows are loaded with ``allow_shape_mismatch`` so a different vocabulary padding is fine too.
Converted models and ``pretrain_rl.py`` checkpoints are written and read through the same
code (``checkpointing``): atomic saves with a manifest, the same
selection of the iteration, the CRC-32 and finite-value checks.

All functions are collective over the default process group and need
``megatron.core.parallel_state`` to be initialised. Layout in full:
docs/checkpointing.md#converted-models.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from loggra_megatron.checkpointing.layout import (
    MODEL_ARGS,
    RELEASE,
    CheckpointRef,
    select_model_checkpoint,
)
from loggra_megatron.model.args import GPTModelArgs

__all__ = [
    "HF_CONFIG_FILE",
    "load_megatron_checkpoint",
    "read_hf_config",
    "read_model_args",
    "save_megatron_checkpoint",
]

HF_CONFIG_FILE = "hf_config.json"
CHECKPOINT_VERSION = 3.0


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_megatron_checkpoint(
    model: torch.nn.Module,
    save_dir: str | os.PathLike,
    args: GPTModelArgs,
    *,
    hf_config: dict[str, Any] | None = None,
    iteration: int | None = None,
) -> str:
    """Save ``model`` (this rank's chunk) as a dist checkpoint under ``save_dir``, as the
    trainer saves (``.tmp`` first, a manifest of every file's size and CRC-32 last, then
    renamed into place and tracked).

    ``iteration=None`` writes the ``release`` iteration (a converted, untrained model).
    Returns the directory holding the dist checkpoint.
    """
    from loggra_megatron.checkpointing.dist_ckpt import publish_checkpoint, write_checkpoint_dir

    try:  # the torch_dist writer process needs it; without, megatron-core 0.16 hangs forever
        import psutil  # noqa: F401
    except ImportError as e:
        raise ImportError("saving a Megatron dist checkpoint needs `pip install psutil`") from e
    save_dir = os.fspath(save_dir)
    sub = RELEASE if iteration is None else f"iter_{iteration:07d}"
    ckpt_dir = os.path.join(save_dir, sub)
    if _rank() == 0 and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise FileExistsError(f"checkpoint directory {ckpt_dir} exists and is not empty")
    state = {
        "model": model.sharded_state_dict(),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration or 0,
    }
    write_checkpoint_dir(state, ckpt_dir + ".tmp", None, True, "nothing was converted")
    if _rank() == 0:
        args.save_json(os.path.join(save_dir, MODEL_ARGS))
        if hf_config is not None:
            with open(os.path.join(save_dir, HF_CONFIG_FILE), "w") as f:
                json.dump(hf_config, f, indent=2, sort_keys=True)
                f.write("\n")
        publish_checkpoint(save_dir, ckpt_dir, f"{RELEASE if iteration is None else iteration}\n")
    _barrier()
    return ckpt_dir


def _find_upwards(load_dir: str, fname: str) -> str | None:
    for d in (load_dir, os.path.dirname(os.path.normpath(load_dir))):
        if os.path.isfile(os.path.join(d, fname)):
            return os.path.join(d, fname)
    return None


def read_model_args(load_dir: str | os.PathLike) -> GPTModelArgs:
    """The ``GPTModelArgs`` saved with a checkpoint (in ``load_dir`` or its parent)."""
    path = _find_upwards(os.fspath(load_dir), MODEL_ARGS)
    if path is None:
        raise FileNotFoundError(
            f"{MODEL_ARGS} not found in {load_dir}: not a checkpoint written by loggra_megatron"
        )
    return GPTModelArgs.load_json(path)


def read_hf_config(load_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The original HF config saved with a converted checkpoint, or ``None``."""
    path = _find_upwards(os.fspath(load_dir), HF_CONFIG_FILE)
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def load_megatron_checkpoint(
    model: torch.nn.Module,
    load_dir: str | os.PathLike | CheckpointRef,
    strict: bool = True,
    verify: bool = True,
) -> CheckpointRef:
    """Load this rank's chunk of ``model`` in place from ``load_dir`` (a directory, resolved
    by ``select_model_checkpoint``, or a ``CheckpointRef``) through the trainer's
    integrity checks: the files' CRC-32 (``verify``; a corrupted iteration falls back to an
    older complete one), its pickles (``UnsafeCheckpointError`` for a class outside the
    allowlist; Transformer Engine's FP8 extra state too, before any module reads it) and
    finite values (``CheckpointError`` naming the tensors). Returns
    the checkpoint loaded, with its warnings.

    Transformer Engine ``_extra_state`` entries (FP8 scaling metadata) the checkpoint does not
    have (it was written with the local layer spec) are left as the model has them, fresh; any other missing tensor is
    an error (with ``strict``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from loggra_megatron.checkpointing.extra_state import EXTRA_STATE_SUFFIX, check_extra_states
    from loggra_megatron.checkpointing.integrity import require_finite, verified_checkpoint
    from loggra_megatron.checkpointing.pickles import check_pickles

    ref = load_dir
    if not isinstance(load_dir, CheckpointRef):
        ref = select_model_checkpoint(load_dir)
    if verify:
        ref = verified_checkpoint(ref)
    ckpt_dir = ref.path
    check_pickles(ckpt_dir)  # before the storage layer unpickles anything of it
    state, _, absent = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, ckpt_dir, strict=StrictHandling.RETURN_UNEXPECTED
    )
    require_finite(state["model"], f"refusing to load {ckpt_dir}")
    check_extra_states(state, ckpt_dir)  # before TE's set_extra_state unpickles any of it
    lacking = sorted(k for k in absent if not k.endswith(EXTRA_STATE_SUFFIX))
    if lacking and strict:
        raise ValueError(
            f"{ckpt_dir} lacks {len(lacking)} tensor(s) of the model, e.g. {lacking[:3]}"
        )
    result = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE_SUFFIX)]
    if strict and (missing or result.unexpected_keys):
        raise ValueError(
            f"{ckpt_dir}: the loaded state does not fit the model (missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]})"
        )
    return ref
