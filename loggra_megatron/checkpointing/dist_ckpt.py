"""Megatron ``dist_checkpointing`` save/load of model + optimizer: atomic, verified, finite.

Save (:func:`save_checkpoint`, collective), with the layout of
:mod:`loggra_megatron.checkpointing.layout`:

1. the weights other DP ranks updated are gathered (``--overlap-param-gather`` defers it
   to the next forward), then every floating-point tensor is checked finite on every rank; a NaN/inf anywhere refuses
   the save on all ranks (:class:`~loggra_megatron.checkpointing.integrity.CheckpointError`)
   before anything is written, so the last good checkpoint stays the latest;
2. all ranks write ``iter_N.tmp`` (``torch_dist``), rank 0 adds the extra files (the run's
   settings), the files are checksummed in parallel and rank 0 writes the manifest last;
3. rank 0 moves ``iter_N.tmp`` into place (an existing ``iter_N`` is first renamed to
   ``iter_N.old``) and replaces the tracker. Every crash point leaves a complete checkpoint
   that :func:`~loggra_megatron.checkpointing.layout.select_checkpoint` finds.

Load (:func:`load_checkpoint`, collective) reads the common (non-tensor) state, checks that
the optimizer state fits this run (LoGRA: same TP/PP size and projection, any DP size;
Megatron's dense Adam: ``dp_reshardable``, any DP size), verifies the files against the
manifest, loads every tensor into fresh buffers, checks them finite, and only then copies
them into the live model and optimizer: a refused load changes nothing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import threading
import time
from dataclasses import replace
from multiprocessing.managers import SyncManager

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from loggra_megatron.checkpointing.integrity import (
    checksum_files,
    list_files,
    require_finite,
    verify_checksums,
)
from loggra_megatron.checkpointing.layout import (
    MANIFEST,
    TRACKER,
    CheckpointError,
    CheckpointRef,
    checkpoint_dir,
    read_manifest,
    select_checkpoint,
    write_atomically,
)
from loggra_megatron.optim.megatron import optimizer_state

MANIFEST_FORMAT = 1


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


def _gather_updated_params(model_chunks) -> None:
    """With ``--overlap-param-gather`` the all-gather of the weights the optimizer updated
    waits for the next forward, so this rank's copy of the shards other DP ranks own is one
    step old: gather them now (collective), as the next forward would."""
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def _fresh_buffers(sharded_state_dict: dict) -> dict:
    """The same request with new, empty tensors, so a failed load leaves the model intact."""

    def fresh(x):
        return replace(x, data=torch.empty_like(x.data)) if isinstance(x, ShardedTensor) else x

    dict_list_map_inplace(fresh, sharded_state_dict)
    return sharded_state_dict


def _exit_with_parent() -> None:
    """Manager-process initializer: a watchdog thread that ends the process once its parent
    (the training rank) is gone, even after a SIGKILL."""

    def watch(ppid: int) -> None:
        while os.getppid() == ppid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, args=(os.getppid(),), daemon=True).start()


def _orphan_safe_writer_queue() -> None:
    """Megatron's ``torch_dist`` writer reports through a queue of a ``multiprocessing``
    Manager it spawns on first use (``filesystem_async._results_queue``, megatron-core
    0.16-0.19). That process outlives a killed rank forever; start it here with a watchdog
    instead, so that kill -9 of a rank leaves no process behind."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_exit_with_parent)
        filesystem_async._results_queue = manager.Queue()


def save_checkpoint(
    root: str,
    iteration: int,
    model_chunks,
    optimizer,
    common: dict,
    extra_models=None,
    files: dict[str, str] | None = None,
    checksums: bool = True,
) -> str:
    """Save model, optimizer (may be None), ``extra_models`` (``{name: chunks}``, e.g. the
    reference policy), ``common`` (picklable: step, data position, scheduler, ...) and
    ``files`` (``{name: text}``, written by rank 0 into the iteration directory).
    ``checksums=False`` records file sizes only. Returns the iteration directory."""
    _gather_updated_params(model_chunks)
    model_sd = _model_sharded_state_dict(model_chunks)
    state = _model_sharded_state_dict(model_chunks, extra_models)
    if optimizer is not None:
        state["optimizer"] = optimizer_state.sharded_state_dict(optimizer, model_sd, False)
    require_finite(state, f"refusing to save iteration {iteration} (the previous checkpoint "
                   "stays the latest)")  # fmt: skip
    state["common"] = common
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    _orphan_safe_writer_queue()
    dist_checkpointing.save(state, tmp)
    _barrier()
    if _rank() == 0:
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
    _barrier()
    table = checksum_files(tmp, list_files(tmp), crc=checksums)
    if _rank() == 0:
        manifest = {"format": MANIFEST_FORMAT, "iteration": iteration, "files": table}
        write_atomically(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1) + "\n")
        _publish(root, iteration, tmp, final)
    _barrier()
    return final


def _publish(root: str, iteration: int, tmp: str, final: str) -> None:
    """Rank 0: move the complete ``tmp`` into place, then point the tracker at it."""
    old = final + ".old"
    if os.path.exists(final):  # re-saving an iteration: keep the previous one until replaced
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    write_atomically(os.path.join(root, TRACKER), str(iteration))
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    checkpoint: str | CheckpointRef,
    model_chunks,
    optimizer,
    iteration: int | None = None,
    extra_models=None,
    verify: bool = True,
) -> dict:
    """Load a checkpoint (a root directory, resolved by ``select_checkpoint`` with
    ``iteration``, or a :class:`CheckpointRef`) and return its ``common`` state.
    ``optimizer=None`` loads the weights only; ``extra_models`` as in
    :func:`save_checkpoint`; ``verify=False`` skips the CRC check (sizes are checked)."""
    ref = checkpoint if isinstance(checkpoint, CheckpointRef) else select_checkpoint(
        checkpoint, iteration
    )  # fmt: skip
    path = ref.path
    saved = dist_checkpointing.load_common_state_dict(path)
    if optimizer is not None:
        if "optimizer" not in saved:
            raise CheckpointError(
                f"checkpoint {path} has no optimizer state; load it with --no-load-optim"
            )
        optimizer_state.check_compatible(optimizer, saved["optimizer"], path)  # ValueError
    manifest = read_manifest(path)
    if manifest is not None and verify:
        verify_checksums(path, manifest)
    model_sd = _model_sharded_state_dict(model_chunks)
    request = _fresh_buffers(_model_sharded_state_dict(model_chunks, extra_models))
    if optimizer is not None:
        request["optimizer"] = optimizer_state.sharded_state_dict(optimizer, model_sd, True)
    loaded = dist_checkpointing.load(request, path)
    if optimizer is not None:  # Megatron drops its padding; uninitialised there
        optimizer_state.zero_padding(loaded["optimizer"])
    require_finite({k: v for k, v in loaded.items() if k != "common"},
                   f"refusing to load {path}")  # fmt: skip
    for i, chunk in enumerate(model_chunks):
        _unwrap(chunk).load_state_dict(loaded[_model_key(i, model_chunks)])
    for name, chunks in (extra_models or {}).items():
        for i, chunk in enumerate(chunks):
            prefix = f"{name}{i}."
            sd = {k.removeprefix(prefix): v for k, v in loaded[f"{name}{i}"].items()}
            _unwrap(chunk).load_state_dict(sd)
    if optimizer is not None:
        optimizer_state.load_state(optimizer, loaded["optimizer"])
    return loaded["common"]
