"""Megatron ``dist_checkpointing`` save/load of model + optimizer, atomic on disk.

Layout of a checkpoint root (``--save DIR``)::

    DIR/iter_0000100/            # one torch_dist checkpoint (all ranks write their shards)
    DIR/latest_checkpointed_iteration.txt

A save writes ``DIR/iter_N.tmp`` on every rank, then rank 0 renames it to ``iter_N`` and
rewrites the tracker file with ``os.replace`` (both atomic on POSIX), so a crash at any
moment leaves the previous complete checkpoint and a tracker that points to it.

A load first reads the common (non-tensor) state, checks that the optimizer state can be
loaded here (LoGRA: same TP/PP size and projection, any DP size), and only then reads the
tensors into fresh buffers before copying them into the live model and optimizer.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor

TRACKER = "latest_checkpointed_iteration.txt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)  # DDP-wrapped chunk -> the MegatronModule


def _model_key(i: int, model_chunks) -> str:
    return "model" if len(model_chunks) == 1 else f"model{i}"


def _model_sharded_state_dict(model_chunks, extra_models=None) -> dict:
    """``{"model": ...}`` (``model0``, ``model1``… with virtual stages) plus one entry per
    extra model (e.g. the frozen reference policy), keyed by its name."""
    state = {
        _model_key(i, model_chunks): _unwrap(chunk).sharded_state_dict()
        for i, chunk in enumerate(model_chunks)
    }
    for name, chunks in (extra_models or {}).items():
        for i, chunk in enumerate(chunks):
            state[f"{name}{i}"] = _unwrap(chunk).sharded_state_dict(prefix=f"{name}{i}.")
    return state


def _fresh_buffers(sharded_state_dict: dict) -> dict:
    """The same request with new, empty tensors, so a failed load leaves the model intact."""

    def fresh(x):
        return replace(x, data=torch.empty_like(x.data)) if isinstance(x, ShardedTensor) else x

    dict_list_map_inplace(fresh, sharded_state_dict)
    return sharded_state_dict


def _leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker file points to, or None if there is no trainer checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    return int(text) if text.isdigit() else None  # "release": a converted model, no trainer state


def save_checkpoint(
    root: str, iteration: int, model_chunks, optimizer, common: dict, extra_models=None
) -> str:
    """Save model, optimizer (may be None), ``extra_models`` (``{name: chunks}``, e.g. the
    reference policy) and ``common`` (picklable: step, data position, scheduler, ...)."""
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd = _model_sharded_state_dict(model_chunks)
    state = _model_sharded_state_dict(model_chunks, extra_models)
    if optimizer is not None:
        state["optimizer"] = [
            leaf.sharded_state_dict(model_sd) for leaf in _leaf_optimizers(optimizer)
        ]
    state["common"] = common
    dist_checkpointing.save(state, tmp)
    _barrier()
    if _rank() == 0:
        if os.path.exists(final):  # re-saving the same iteration: keep it until replaced
            shutil.rmtree(final + ".old", ignore_errors=True)
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        shutil.rmtree(final + ".old", ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(
    root: str, model_chunks, optimizer, iteration: int | None = None, extra_models=None
) -> dict:
    """Load the checkpoint at ``iteration`` (default: latest) and return its ``common``.
    ``optimizer=None`` loads the weights only; ``extra_models`` as in :func:`save_checkpoint`."""
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint under {root!r} (missing {TRACKER})")
    path = checkpoint_dir(root, iteration)
    saved = dist_checkpointing.load_common_state_dict(path)
    leaves = _leaf_optimizers(optimizer) if optimizer is not None else []
    if optimizer is not None:
        if "optimizer" not in saved:
            raise ValueError(
                f"checkpoint {path} has no optimizer state; load it with --no-load-optim"
            )
        if len(saved["optimizer"]) != len(leaves):
            raise ValueError(
                f"checkpoint {path} has {len(saved['optimizer'])} optimizer(s), this run "
                f"has {len(leaves)}: the model's parameter groups differ"
            )
        for leaf, leaf_saved in zip(leaves, saved["optimizer"], strict=True):
            if hasattr(leaf, "check_compatible"):
                leaf.check_compatible(leaf_saved["loggra"])
    model_sd = _model_sharded_state_dict(model_chunks)
    request = _fresh_buffers(_model_sharded_state_dict(model_chunks, extra_models))
    if optimizer is not None:
        request["optimizer"] = [
            leaf.sharded_state_dict(model_sd, is_loading=True) for leaf in leaves
        ]
    loaded = dist_checkpointing.load(request, path)
    for i, chunk in enumerate(model_chunks):
        _unwrap(chunk).load_state_dict(loaded[_model_key(i, model_chunks)])
    for name, chunks in (extra_models or {}).items():
        for i, chunk in enumerate(chunks):
            prefix = f"{name}{i}."
            sd = {k.removeprefix(prefix): v for k, v in loaded[f"{name}{i}"].items()}
            _unwrap(chunk).load_state_dict(sd)
    if optimizer is not None:
        with torch.no_grad():
            for leaf, leaf_state in zip(leaves, loaded["optimizer"], strict=True):
                leaf.load_state_dict(leaf_state)
    return loaded["common"]
