"""Checkpoint integrity: CRC-32 of every file, and finite tensors on save and on load.

* **Checksums.** After ``dist_checkpointing`` has written a checkpoint, the files are split
  round-robin over the ranks; each rank reads back and checksums its share (CRC-32, about
  2 GB/s per rank) and rank 0 writes them to the manifest, last. A load verifies the same
  way, over the ranks of the loading job, before any tensor is read: a flipped bit in a
  weight (1e37 is finite) is caught, not trained on, and the load falls back to the newest
  older complete checkpoint (``verified_checkpoint``) unless one was asked for by
  number.
* **Finite values.** Every floating-point tensor about to be saved is checked, and so is
  every tensor just loaded (before it is copied into the live model or optimizer). A
  non-finite value anywhere (any rank) refuses the save or the load on every rank, naming
  the tensors.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedBase

from loggra_megatron.checkpointing.layout import (
    MANIFEST,
    CheckpointError,
    CheckpointRef,
    file_crc32,
    older_checkpoint,
    read_manifest,
)


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (collective; ``[obj]`` without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def checksum_files(path: str, files: list[str], crc: bool = True) -> dict[str, dict]:
    """``{file: {"bytes", "crc32"?}}`` of ``files``, computed in parallel over the ranks
    (collective; every rank returns the whole table)."""
    rank, world = _world()
    mine = {}
    for rel in files[rank::world]:
        full = os.path.join(path, rel)
        mine[rel] = {"bytes": os.path.getsize(full)}
        if crc:
            mine[rel]["crc32"] = file_crc32(full)
    table = {}
    for part in gather_objects(mine):
        table.update(part)
    return table


def _checksum_problems(path: str, manifest: dict) -> list[str]:
    """What differs from the manifest in ``path`` (collective: each rank checks its
    round-robin share; every rank returns the whole list)."""
    rank, world = _world()
    problems = []
    files = sorted(manifest["files"])
    for rel in files[rank::world]:
        expected, full = manifest["files"][rel], os.path.join(path, rel)
        if not os.path.isfile(full):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(full) != expected["bytes"]:
            problems.append(f"{rel} has the wrong size")
        elif "crc32" in expected and file_crc32(full) != expected["crc32"]:
            problems.append(f"{rel} fails its CRC-32 check (corrupted on disk)")
    return [p for part in gather_objects(problems) for p in part]


def verified_checkpoint(ref: CheckpointRef) -> CheckpointRef:
    """``ref`` if its files match the manifest's sizes and CRC-32 (collective), else the
    newest older complete checkpoint that does (``older_checkpoint``, with a warning in
    its ``warnings``). Raises ``CheckpointError`` on every rank when there is none, or
    when ``ref`` was asked for by number. A converted model written before manifests existed
    has none and is returned as it is; a manifest of sizes only, with a warning that the
    bytes were not verified."""
    while True:
        manifest = read_manifest(ref.path)
        if manifest is None and ref.iteration is None:
            return ref
        problems = _checksum_problems(ref.path, manifest) if manifest else [f"no valid {MANIFEST}"]
        if not problems:
            return _sizes_only_note(ref, manifest)
        why = f"is corrupted: {'; '.join(problems[:5])}"
        older = older_checkpoint(ref, why)
        if older is None:
            fix = "there is no older complete checkpoint to fall back to"
            if ref.pinned:
                fix = "load another iteration with --ckpt-step N"
            raise CheckpointError(
                f"checkpoint {ref.path} {why}. Nothing was loaded; {fix} (or restore the files)."
            )
        ref = older


def _sizes_only_note(ref: CheckpointRef, manifest: dict) -> CheckpointRef:
    """``ref``, with a warning if its manifest records sizes only (a save with
    ``--no-checkpoint-checksums``): its bytes could not be verified."""
    if any("crc32" in entry for entry in manifest["files"].values()):
        return ref
    note = (
        f"{os.path.join(ref.path, MANIFEST)} records file sizes only (saved with "
        "--no-checkpoint-checksums): the bytes of the checkpoint were not verified"
    )
    return replace(ref, warnings=[*ref.warnings, note])


def _tensors(state, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in a nested dict/list: a sharded tensor by its
    checkpoint key, a loaded one by its path in the state dict."""
    if isinstance(state, dict | list):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        return [t for k, v in items for t in _tensors(v, f"{path}.{k}" if path else str(k))]
    if isinstance(state, ShardedBase):  # ShardedTensor / ShardedTensorFactory
        data = getattr(state, "data", None)  # ShardedObject: pickled state, not checked
        return [(state.key, data)] if torch.is_tensor(data) else []
    return [(path, state)] if torch.is_tensor(state) else []


def nonfinite_tensors(state) -> list[str]:
    """Keys of the floating-point tensors in ``state`` (a nested dict/list of sharded or
    plain tensors) that hold a NaN or an infinity, on this rank. Step counters are not
    checked: torch AdamW's per-param ``step`` in Megatron's ``dp_reshardable`` buckets is a
    placeholder on a DP-resharded load (the step is restored from the param groups). The
    buckets' padding, uninitialised memory, is zeroed before this check
    (``loggra_megatron.optim.megatron.optimizer_state.zero_padding``)."""
    bad = []
    for key, t in _tensors(state):
        if key.endswith(".step"):
            continue
        if t is not None and t.is_floating_point() and t.numel() and not bool(t.isfinite().all()):
            bad.append(key)
    return bad


def require_finite(state, what: str) -> None:
    """Raise ``CheckpointError`` on every rank if any rank's ``state`` has a
    non-finite tensor (collective)."""
    bad = sorted({key for part in gather_objects(nonfinite_tensors(state)) for key in part})
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(f"{what}: non-finite values (NaN/inf) in {shown}")
