# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Megatron-Core distributed checkpoints of a converted GPT model.

Layout (the one Megatron-LM's ``--load`` understands, iteration ``release``)::

    DIR/latest_checkpointed_iteration.txt   "release"
    DIR/release/                            dist_checkpointing, torch_dist format:
                                            {"model": model.sharded_state_dict(),
                                             "checkpoint_version": 3.0, "iteration": 0}
    DIR/loggra_model_args.json              GPTModelArgs (the architecture)
    DIR/hf_config.json                      original HF config.json (if converted from HF)

``torch_dist`` stores *global* tensors (TP shards and PP stages are reassembled on save), so
a checkpoint saved at one TP/PP loads at any other that the architecture allows; the
embedding/output rows are loaded with ``allow_shape_mismatch`` so a different vocabulary
padding is fine too.

All functions are collective over the default process group and need
``megatron.core.parallel_state`` to be initialised.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from loggra_megatron.checkpointing.layout import MODEL_ARGS, TRACKER, write_atomically
from loggra_megatron.model.args import GPTModelArgs

__all__ = [
    "HF_CONFIG_FILE",
    "load_megatron_checkpoint",
    "read_hf_config",
    "read_model_args",
    "resolve_checkpoint_dir",
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
    """Save ``model`` (this rank's chunk) as a dist checkpoint under ``save_dir``.

    ``iteration=None`` writes the ``release`` iteration (a converted, untrained model).
    Returns the directory holding the dist checkpoint.
    """
    from megatron.core import dist_checkpointing

    try:  # the torch_dist writer process needs it; without, megatron-core 0.16 hangs forever
        import psutil  # noqa: F401
    except ImportError as e:
        raise ImportError("saving a Megatron dist checkpoint needs `pip install psutil`") from e
    save_dir = os.fspath(save_dir)
    sub = "release" if iteration is None else f"iter_{iteration:07d}"
    ckpt_dir = os.path.join(save_dir, sub)
    if _rank() == 0:
        if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
            raise FileExistsError(f"checkpoint directory {ckpt_dir} exists and is not empty")
        os.makedirs(ckpt_dir, exist_ok=True)
    _barrier()
    state = {
        "model": model.sharded_state_dict(),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration or 0,
    }
    dist_checkpointing.save(state, ckpt_dir)
    if _rank() == 0:
        args.save_json(os.path.join(save_dir, MODEL_ARGS))
        if hf_config is not None:
            with open(os.path.join(save_dir, HF_CONFIG_FILE), "w") as f:
                json.dump(hf_config, f, indent=2, sort_keys=True)
                f.write("\n")
        write_atomically(os.path.join(save_dir, TRACKER),
                         f"{'release' if iteration is None else iteration}\n")  # fmt: skip
    _barrier()
    return ckpt_dir


def resolve_checkpoint_dir(load_dir: str | os.PathLike) -> str:
    """The dist-checkpoint directory of ``load_dir``: the iteration named by its tracker
    file, or ``load_dir`` itself if it is a dist checkpoint (has ``metadata.json``)."""
    load_dir = os.fspath(load_dir)
    tracker = os.path.join(load_dir, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        sub = "release" if it == "release" else f"iter_{int(it):07d}"
        path = os.path.join(load_dir, sub)
    else:
        path = load_dir
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path} is not a Megatron dist checkpoint (no metadata.json)")
    return path


def _find_upwards(load_dir: str, fname: str) -> str | None:
    for d in (load_dir, os.path.dirname(os.path.normpath(load_dir))):
        if os.path.isfile(os.path.join(d, fname)):
            return os.path.join(d, fname)
    return None


def read_model_args(load_dir: str | os.PathLike) -> GPTModelArgs:
    """The :class:`GPTModelArgs` saved with a checkpoint (in ``load_dir`` or its parent)."""
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


EXTRA_STATE = "_extra_state"
"""Transformer Engine's per-module extra state (FP8 scaling metadata): a model built with
``--transformer-impl transformer_engine`` has it, a checkpoint written with the local spec
does not (and the other way round); it starts fresh when absent."""


def load_megatron_checkpoint(
    model: torch.nn.Module, load_dir: str | os.PathLike, strict: bool = True
) -> None:
    """Load this rank's chunk of ``model`` in place from the dist checkpoint ``load_dir``.

    Transformer Engine ``_extra_state`` entries the checkpoint does not have (it was written
    with the local layer spec) are left as the model has them; any other missing tensor is
    an error (with ``strict``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    ckpt_dir = resolve_checkpoint_dir(load_dir)
    state, _, absent = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, ckpt_dir, strict=StrictHandling.RETURN_UNEXPECTED
    )
    lacking = sorted(k for k in absent if not k.endswith(EXTRA_STATE))
    if lacking and strict:
        raise ValueError(f"{ckpt_dir} lacks {len(lacking)} tensor(s) of the model, e.g. {lacking[:3]}")
    result = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
    if strict and (missing or result.unexpected_keys):
        raise ValueError(
            f"{ckpt_dir}: the loaded state does not fit the model (missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]})"
        )
