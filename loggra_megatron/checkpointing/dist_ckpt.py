"""Megatron ``dist_checkpointing`` save/load of model + optimizer: atomic, verified, finite.

``save_checkpoint`` (collective) gathers the weights other DP ranks updated, refuses a
non-finite tensor on all ranks before anything is written
(``CheckpointError``), writes ``iter_N.tmp``
(``torch_dist``) with a manifest of sizes and CRC-32s written last, renames it into place
and then replaces the tracker (layout: ``checkpointing.layout``), so
every crash point leaves a complete checkpoint. ``load_checkpoint`` (collective)
verifies the files against the manifest (falling back to an older complete checkpoint),
checks that the optimizer state fits this run, loads every tensor into fresh buffers,
checks them finite, and only then copies them into the live model and optimizer: a refused
load changes nothing. Every pickle of a checkpoint is read through an allowlist before the
storage layer reads it (``checkpointing.pickles``). The writer processes Megatron forks for a
save die with their rank, kill -9 included (``_die_with_parent``).

Step by step: docs/checkpointing.md#saving-atomic-verified-finite and
docs/checkpointing.md#loading-which-iteration.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from loggra_megatron.checkpointing.extra_state import check_extra_states
from loggra_megatron.checkpointing.integrity import (
    checksum_files,
    gather_objects,
    require_finite,
    verified_checkpoint,
)
from loggra_megatron.checkpointing.layout import (
    MANIFEST,
    TRACKER,
    CheckpointError,
    CheckpointRef,
    checkpoint_dir,
    list_files,
    select_checkpoint,
    write_atomically,
)
from loggra_megatron.checkpointing.pickles import check_pickles
from loggra_megatron.checkpointing.writer_queue import install_writer_queue
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


_saving_pid: int | None = None
"""This process's pid while it writes a checkpoint (``_writers_die_with_this_process``)."""


def _die_with_parent() -> None:
    """After ``fork``, in a child forked while a checkpoint is written (Megatron's writer
    processes): killed when its parent ends, kill -9 included (Linux ``PR_SET_PDEATHSIG``),
    and ended at once if the parent already has. A writer outliving a killed rank used to
    wait forever on a queue to it, holding the rank's files and locks."""
    global _saving_pid
    if _saving_pid is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _saving_pid:
        os._exit(1)
    _saving_pid = os.getpid()  # and the processes it forks die with it


@contextmanager
def _writers_die_with_this_process():
    global _saving_pid
    _saving_pid = os.getpid()
    try:
        yield
    finally:
        _saving_pid = None


if sys.platform == "linux":
    _PR_SET_PDEATHSIG = 1
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in a forked child
    os.register_at_fork(after_in_child=_die_with_parent)


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
    keeps = "the previous checkpoint stays the latest"
    require_finite(state, f"refusing to save iteration {iteration} ({keeps})")
    state["common"] = common
    final = checkpoint_dir(root, iteration)
    write_checkpoint_dir(state, final + ".tmp", files, checksums, keeps)
    if _rank() == 0:
        publish_checkpoint(root, final, str(iteration))
    _barrier()
    return final


class _WriteFailed(OSError):
    """An I/O error on some rank while a checkpoint directory was written."""


def _on_rank0(write) -> None:
    """``write()`` on rank 0; its ``OSError`` is raised on every rank (collective)."""
    error = None
    if _rank() == 0:
        try:
            write()
        except OSError as e:
            error = str(e)
    errors = [e for e in gather_objects(error) if e]
    if errors:
        raise _WriteFailed(errors[0])


def _write_files(directory: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)


def _first_os_error(error: BaseException) -> str:
    """The first line of the error behind ``error``, an I/O error if there is one: Megatron
    reports a writer's failure as a ``CheckpointException`` of every rank's failures (on the
    coordinator; they cross ranks pickled, without their causes)."""
    pending, found = [error], []
    while pending:
        e = pending.pop(0)
        if e is None or e in found:
            continue
        found.append(e)
        failures = getattr(e, "failures", None) or {}
        pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [e.__cause__, e.__context__]
    causes = [e for e in found if not isinstance(e, _WriteFailed | CheckpointException)]
    best = next((e for e in causes if isinstance(e, OSError)), causes[0] if causes else error)
    return str(best).splitlines()[0] if str(best) else type(best).__name__


def write_checkpoint_dir(
    state: dict, tmp: str, files: dict[str, str] | None, checksums: bool, keeps: str
) -> None:
    """Write ``state`` (``dist_checkpointing``, every rank) into a new directory ``tmp``,
    then rank 0's ``files`` and, last, the manifest of every file's size and CRC-32
    (computed in parallel over the ranks). Collective. An I/O error on any rank (a full
    disk) removes ``tmp`` and raises ``CheckpointError`` on every rank, in one line
    ending with ``keeps`` (what is still there)."""
    try:
        _on_rank0(lambda: (shutil.rmtree(tmp, ignore_errors=True), os.makedirs(tmp)))
        install_writer_queue()
        with _writers_die_with_this_process():
            dist_checkpointing.save(state, tmp)
        _on_rank0(lambda: _write_files(tmp, files or {}))
        table = checksum_files(tmp, list_files(tmp), crc=checksums)
        manifest = {"format": MANIFEST_FORMAT, "files": table}
        text = json.dumps(manifest, indent=1) + "\n"
        _on_rank0(lambda: write_atomically(os.path.join(tmp, MANIFEST), text))
    except (OSError, CheckpointException) as e:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"writing {tmp} failed: {_first_os_error(e)}; the partial directory was removed "
            f"and {keeps}"
        ) from None


def publish_checkpoint(root: str, final: str, tracker: str) -> None:
    """Rank 0: move the complete ``final + ".tmp"`` into place, then point the tracker at
    it (an existing ``final`` is kept as ``final + ".old"`` until then)."""
    tmp, old = final + ".tmp", final + ".old"
    if os.path.exists(final):  # re-saving an iteration: keep the previous one until replaced
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    write_atomically(os.path.join(root, TRACKER), tracker)
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
    ``iteration``, or a ``CheckpointRef``) and return its ``common`` state.
    ``optimizer=None`` loads the weights only; ``extra_models`` as in
    ``save_checkpoint``. ``verify``: the files are checked against the manifest's
    CRC-32 first, falling back to an older checkpoint if they fail
    (``verified_checkpoint``; call it yourself to
    learn which one); ``verify=False`` skips that (sizes were checked at selection). Every
    pickle of the checkpoint is checked first (``pickles.check_pickles``: a crafted file
    raises ``UnsafeCheckpointError``), and Transformer Engine's FP8 extra state, a pickle
    inside a tensor, before any module reads it (``extra_state.check_extra_states``)."""
    ref = checkpoint
    if not isinstance(checkpoint, CheckpointRef):
        ref = select_checkpoint(checkpoint, iteration)
    if verify:
        ref = verified_checkpoint(ref)
    path = ref.path
    check_pickles(path)  # before the storage layer unpickles anything of it
    saved = dist_checkpointing.load_common_state_dict(path)
    if optimizer is not None:
        if "optimizer" not in saved:
            raise CheckpointError(
                f"checkpoint {path} has no optimizer state; load it with --no-load-optim"
            )
        optimizer_state.check_compatible(optimizer, saved["optimizer"], path)  # ValueError
    model_sd = _model_sharded_state_dict(model_chunks)
    request = _fresh_buffers(_model_sharded_state_dict(model_chunks, extra_models))
    if optimizer is not None:
        request["optimizer"] = optimizer_state.sharded_state_dict(optimizer, model_sd, True)
    loaded = dist_checkpointing.load(request, path)
    check_extra_states(loaded, path)  # before TE's set_extra_state unpickles any of it
    if optimizer is not None:  # Megatron drops its padding; uninitialised there
        optimizer_state.zero_padding(loaded["optimizer"])
    require_finite({k: v for k, v in loaded.items() if k != "common"}, f"refusing to load {path}")
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
