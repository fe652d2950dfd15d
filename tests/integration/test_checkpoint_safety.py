"""Checkpoint safety: refused saves and loads, every crash point of a re-save, fallback to the
newest complete iteration, corruption caught by the manifest (and the fallback it causes),
and a full disk."""

import contextlib
import errno
import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from crafted_pickles import Opens

from loggra_megatron.checkpointing.layout import (
    MANIFEST,
    TRACKER,
    checkpoint_dir,
    latest_iteration,
    select_checkpoint,
)
from loggra_megatron.testing import run_distributed, tiny_gpt_model, wrap_ddp

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

OUTPUT = "output_layer.weight"


def _build():
    from megatron.core.optimizer import OptimizerConfig

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer

    model = tiny_gpt_model(hidden_size=32, vocab=64, seq=8, use_cpu_initialization=True)
    ddp = wrap_ddp(model, use_distributed_optimizer=True)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True)
    return ddp, get_loggra_optimizer(
        config, [ddp], LoGRAConfig(loggra_sketch="gradient", loggra_rank=4, loggra_min_dim=8)
    )


def _params(ddp) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _set_output(ddp, value: float) -> None:
    with torch.no_grad():
        dict(ddp.module.named_parameters())[OUTPUT].fill_(value)
        ddp.module.output_layer.weight.data.view(-1)[0] = value + 0.5  # a distinctive entry


def _fresh_optimizer_state(opt):
    """Masters follow the model weights (a test shortcut for 'weights were trained')."""
    opt.reload_model_params()


# ---------------------------------------------------------------- refused save
def _nonfinite_save(rank, root):
    from loggra_megatron.checkpointing import CheckpointError, save_checkpoint

    ddp, opt = _build()
    save_checkpoint(root, 1, [ddp], opt, common={"step": 1})
    if rank == 1:  # one rank's weight goes non-finite
        with torch.no_grad():
            ddp.module.output_layer.weight.data.view(-1)[3] = math.inf
    with pytest.raises(CheckpointError, match=r"refusing to save iteration 2.*output_layer"):
        save_checkpoint(root, 2, [ddp], opt, common={"step": 2})
    return sorted(os.listdir(root))


def test_a_nonfinite_weight_on_one_rank_refuses_the_save_everywhere(tmp_path):
    root = str(tmp_path / "ckpt")
    listings = run_distributed(_nonfinite_save, 2, root)
    assert listings[0] == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert latest_iteration(root) == 1


# ---------------------------------------------------------------- helper processes of a save
def _writer_queue_server_after_a_save(rank, root):
    """A save, then the processes this rank started that still run: each one's command line,
    pid and the torch libraries it has loaded."""
    import psutil

    from loggra_megatron.checkpointing import save_checkpoint

    ddp, opt = _build()
    save_checkpoint(root, 1, [ddp], opt, common={"step": 1})
    left = []
    for child in psutil.Process().children():
        libraries = {os.path.basename(m.path) for m in child.memory_maps()}
        torch_libraries = sorted(n for n in libraries if n.startswith(("libtorch", "libc10")))
        left.append((" ".join(child.cmdline()), child.pid, torch_libraries))
    return left


def test_the_writer_queue_server_never_imports_torch_and_dies_with_its_rank(tmp_path):
    """Megatron's writer results queue lives in a server process. Spawned by
    ``multiprocessing``, it imported the rank's main script, its initializer's module
    (Megatron-Core) and, storing each write result, torch: 375 MiB and 5.7 s of CPU per
    rank. Ours holds pickled bytes, starts as ``python -m``, stays the only process left
    after a save, and ends once its rank has."""
    import psutil

    (left,) = run_distributed(_writer_queue_server_after_a_save, 1, str(tmp_path / "ckpt"))
    assert len(left) == 1, left
    ((command, pid, torch_libraries),) = left
    assert command.endswith("-m loggra_megatron.checkpointing.writer_queue"), command
    assert torch_libraries == []
    with contextlib.suppress(psutil.NoSuchProcess):
        _, alive = psutil.wait_procs([psutil.Process(pid)], timeout=30)
        assert not alive


# ---------------------------------------------------------------- crash points of a re-save
class _Crash(Exception):
    pass


def _resave_with_crash(rank, root, crash_at):
    """Save iteration 1 with weights A, then re-save it with weights B, crashing at the
    ``crash_at``-th ``os.replace`` of rank 0 (None: no crash). Returns A, B and what a
    fresh model loads afterwards."""
    import loggra_megatron.checkpointing.dist_ckpt as dist_ckpt
    import loggra_megatron.checkpointing.layout as layout
    from loggra_megatron.checkpointing import load_checkpoint, save_checkpoint

    ddp, opt = _build()
    _set_output(ddp, 1.0)
    _fresh_optimizer_state(opt)
    save_checkpoint(root, 1, [ddp], opt, common={"version": "A"})
    a = _params(ddp)
    _set_output(ddp, 2.0)
    _fresh_optimizer_state(opt)
    b = _params(ddp)
    calls, real_replace = [0], os.replace

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == crash_at:
            raise _Crash(f"killed before os.replace({src}, {dst})")
        real_replace(src, dst)

    for module in (dist_ckpt, layout):
        module.os.replace = replace  # the same os module: patched once, restored below
    try:
        save_checkpoint(root, 1, [ddp], opt, common={"version": "B"})
        crashed = False
    except _Crash:
        crashed = True
    finally:
        os.replace = real_replace
    ref = select_checkpoint(root)
    ddp2, opt2 = _build()
    common = load_checkpoint(ref, [ddp2], opt2)
    return {
        "a": a,
        "b": b,
        "loaded": _params(ddp2),
        "version": common["version"],
        "crashed": crashed,
        "calls": calls[0],
        "warnings": ref.warnings,
        "path": ref.path,
    }


def _resave_crashing_at_each_point(rank, root):
    """``_resave_with_crash`` without a crash, then crashing at each ``os.replace`` of that
    re-save in turn, each in a directory of its own: the results in that order."""
    clean = _resave_with_crash(rank, os.path.join(root, "clean"), None)
    crashes = range(1, clean["calls"] + 1)
    return [clean] + [_resave_with_crash(rank, os.path.join(root, f"crash{k}"), k) for k in crashes]


def test_every_crash_point_of_a_resave_leaves_a_loadable_complete_checkpoint(tmp_path):
    """os.replace calls of a re-save: the manifest, iter_N -> .old, .tmp -> iter_N, the
    tracker. A crash before each one leaves the old or the new state, whole."""
    ((clean, *crashed),) = run_distributed(_resave_crashing_at_each_point, 1, str(tmp_path))
    assert not clean["crashed"] and clean["version"] == "B"
    assert all(torch.equal(clean["loaded"][k], clean["b"][k]) for k in clean["b"])
    assert len(crashed) == clean["calls"] >= 4  # the manifest, two renames, the tracker
    seen = set()
    for k, r in enumerate(crashed, 1):
        assert r["crashed"], k
        expected = r["a"] if r["version"] == "A" else r["b"]
        assert all(torch.equal(r["loaded"][n], expected[n]) for n in expected), (k, r["version"])
        seen.add(r["version"])
        if r["warnings"]:  # the crash between the two renames: iter_N is missing
            assert "falling back" in r["warnings"][-1] and r["path"].endswith(".tmp")
    assert seen == {"A", "B"}  # early crashes keep A, late ones already have B


def test_select_checkpoint_falls_back_to_the_newest_complete_iteration(tmp_path):
    root = tmp_path / "ckpt"
    for it in (1, 2, 3):
        d = root / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "data").write_text("x" * it)
        (d / MANIFEST).write_text(json.dumps({"files": {"data": {"bytes": it}}}))
    (root / TRACKER).write_text("3")
    assert select_checkpoint(str(root)).iteration == 3
    (root / "iter_0000003" / MANIFEST).unlink()  # interrupted: no manifest
    ref = select_checkpoint(str(root))
    assert ref.iteration == 2 and "no readable manifest.json" in ref.warnings[0]
    (root / "iter_0000002" / "data").write_text("truncated"[:1])  # wrong size
    ref = select_checkpoint(str(root))
    assert ref.iteration == 1 and any("is damaged" in w for w in ref.warnings)
    with pytest.raises(FileNotFoundError, match="no readable manifest"):
        select_checkpoint(str(root), iteration=3)
    assert select_checkpoint(str(root), iteration=1).iteration == 1


# ---------------------------------------------------------------- corruption on disk
def _save_then_corrupt(rank, root, value, checksums):
    """Save, then overwrite the first output-layer weight in the file with ``value``."""
    from loggra_megatron.checkpointing import save_checkpoint

    ddp, opt = _build()
    _set_output(ddp, 1.0)
    _fresh_optimizer_state(opt)
    path = save_checkpoint(root, 1, [ddp], opt, common={}, checksums=checksums)
    needle = struct.pack("<ff", 1.5, 1.0)  # the distinctive entry and its neighbour
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        with open(full, "rb") as f:
            data = f.read()
        if name.endswith(".distcp") and needle in data:
            i = data.index(needle)
            data = data[:i] + struct.pack("<f", value) + data[i + 4 :]
            with open(full, "wb") as f:
                f.write(data)
            return name
    raise AssertionError("weight bytes not found")


def _load_refused(rank, root, match):
    from loggra_megatron.checkpointing import CheckpointError, load_checkpoint

    ddp, opt = _build()
    before = _params(ddp)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(root, [ddp], opt)
    after = _params(ddp)
    return all(torch.equal(before[k], after[k]) for k in before)


def test_a_flipped_exponent_is_caught_by_the_checksum(tmp_path):
    """1.5 -> 1e37 is finite: only the CRC sees it. The load changes nothing."""
    root = str(tmp_path / "ckpt")
    (name,) = run_distributed(_save_then_corrupt, 1, root, 1e37, True)
    assert run_distributed(_load_refused, 1, root, rf"{name} fails its CRC-32 check") == [True]


def test_a_nonfinite_tensor_is_refused_after_loading(tmp_path):
    """Without checksums (sizes only), a NaN written into the file is refused by the
    finite-value check before anything reaches the live model."""
    root = str(tmp_path / "ckpt")
    run_distributed(_save_then_corrupt, 1, root, math.nan, False)
    manifest = json.loads(Path(checkpoint_dir(root, 1), MANIFEST).read_text())
    assert all("crc32" not in e for e in manifest["files"].values())
    match = r"refusing to load .*non-finite values .* in .*output_layer"
    assert run_distributed(_load_refused, 1, root, match) == [True]
    from loggra_megatron.checkpointing.integrity import verified_checkpoint

    ref = verified_checkpoint(select_checkpoint(root))  # the note a verifying load prints
    assert "records file sizes only (saved with --no-checkpoint-checksums)" in ref.warnings[-1]


def _two_iterations_newest_corrupted(rank, root):
    """Iterations 1 (weights A) and 2 (B); then a flipped exponent in iteration 2's file."""
    from loggra_megatron.checkpointing import save_checkpoint

    ddp, opt = _build()
    for iteration, value in ((1, 1.0), (2, 2.0)):
        _set_output(ddp, value)
        _fresh_optimizer_state(opt)
        save_checkpoint(root, iteration, [ddp], opt, common={"iteration": iteration})
    path = checkpoint_dir(root, 2)
    needle = struct.pack("<ff", 2.5, 2.0)
    for name in sorted(os.listdir(path)):
        data = Path(path, name).read_bytes()
        if name.endswith(".distcp") and needle in data:
            i = data.index(needle)
            Path(path, name).write_bytes(data[:i] + struct.pack("<f", 1e37) + data[i + 4 :])
            return name
    raise AssertionError("weight bytes not found")


def _load_with_fallback(rank, root):
    from loggra_megatron.checkpointing import CheckpointError, load_checkpoint
    from loggra_megatron.checkpointing.integrity import verified_checkpoint

    ddp, opt = _build()
    ref = verified_checkpoint(select_checkpoint(root))
    common = load_checkpoint(root, [ddp], opt)  # the same, inside load_checkpoint
    output = dict(ddp.module.named_parameters())[OUTPUT].detach().view(-1)[0].item()
    with pytest.raises(CheckpointError, match="fails its CRC-32 check.*--ckpt-step"):
        load_checkpoint(root, [ddp], opt, iteration=2)  # asked for by number: no fallback
    return ref.iteration, ref.warnings, common["iteration"], output


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    """The CRC check fails on the tracked iteration: the load falls back to the newest older
    complete checkpoint with a warning (it used to refuse and ask for --ckpt-step)."""
    root = str(tmp_path / "ckpt")
    (name,) = run_distributed(_two_iterations_newest_corrupted, 1, root)
    for iteration, warnings, loaded, output in run_distributed(_load_with_fallback, 2, root):
        assert iteration == 1 and loaded == 1 and output == 1.5
        assert f"{name} fails its CRC-32 check" in warnings[0] and "falling back" in warnings[-1]


def _loaded_output(rank, root):
    from loggra_megatron.checkpointing import load_checkpoint

    ddp, opt = _build()
    load_checkpoint(root, [ddp], opt)
    return dict(ddp.module.named_parameters())[OUTPUT].detach().view(-1)[0].item()


def test_a_crc32_stripped_over_damaged_bytes_still_falls_back(tmp_path):
    """The damaged file's CRC-32 removed from the manifest: its bytes used to load without a
    note. A manifest that lists a CRC-32 for some files only is damaged: the load falls back."""
    root = str(tmp_path / "ckpt")
    (name,) = run_distributed(_two_iterations_newest_corrupted, 1, root)
    manifest = Path(checkpoint_dir(root, 2), MANIFEST)
    table = json.loads(manifest.read_text())
    del table["files"][name]["crc32"]
    manifest.write_text(json.dumps(table))
    ref = select_checkpoint(root)
    assert ref.iteration == 1, ref
    assert f"{name} has no CRC-32 in manifest.json, unlike the other files" in ref.warnings[0]
    assert run_distributed(_loaded_output, 1, root) == [1.5]  # weights A


def _save_on_a_full_disk(rank, root):
    """Iteration 1 saves; iteration 2 runs out of space on rank 1 only (after writing part
    of a file). Returns the error of this rank and the directory afterwards."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from loggra_megatron.checkpointing import CheckpointError, save_checkpoint

    ddp, opt = _build()
    save_checkpoint(root, 1, [ddp], opt, common={})

    def full_disk(*args, **kwargs):
        next(a for a in args if hasattr(a, "write")).write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = filesystem_async._write_item
    if rank == 1:
        filesystem_async._write_item = full_disk  # the forked writer inherits it
    try:
        with pytest.raises(CheckpointError) as refused:
            save_checkpoint(root, 2, [ddp], opt, common={})
    finally:
        filesystem_async._write_item = real
    return str(refused.value), sorted(os.listdir(root))


def test_a_full_disk_refuses_the_save_in_one_line_and_frees_the_partial_directory(tmp_path):
    """It used to end in a raw traceback with iter_N.tmp left holding the space."""
    root = str(tmp_path / "ckpt")
    (message, listing), _ = run_distributed(_save_on_a_full_disk, 2, root)
    # megatron-core 0.19's writer keeps the error's class only ("error: <class 'OSError'>")
    assert "\n" not in message, message
    assert "No space left on device" in message or "'OSError'" in message, message
    assert "iter_0000002.tmp" in message and "the previous checkpoint stays the latest" in message
    assert listing == ["iter_0000001", TRACKER] and latest_iteration(root) == 1


# ---------------------------------------------------------------- TE's FP8 extra state


def _extra_state_round_trip(rank, root, crafted_marker):
    """Save with fc1's extra state as TE 2.x writes it (a pickle in a byte tensor: a crafted
    one when ``crafted_marker``), then load into a model whose fc1 reads it as TE's
    ``set_extra_state`` does (``pickle.loads``). Returns what fc1 read, or the refusal."""
    import pickle

    from loggra_megatron.checkpointing import load_checkpoint, save_checkpoint
    from loggra_megatron.checkpointing.pickles import UnsafeCheckpointError

    ddp, opt = _build()
    fc1 = ddp.module.decoder.layers[0].mlp.linear_fc1
    state = {"extra_fp8_variables": {"num_gemms": 1}, "scale_fwd": torch.ones(3)}
    if crafted_marker is not None:
        state["recipe"] = Opens(crafted_marker)
    data = bytearray(pickle.dumps(state))
    fc1.get_extra_state = lambda: torch.frombuffer(data, dtype=torch.uint8)
    save_checkpoint(root, 1, [ddp], opt, common={})
    ddp, opt = _build()
    read = []
    fc1 = ddp.module.decoder.layers[0].mlp.linear_fc1
    fc1.set_extra_state = lambda s: read.append(pickle.loads(s.numpy().tobytes()))
    try:
        load_checkpoint(root, [ddp], opt)
    except UnsafeCheckpointError as e:
        return str(e)
    return read


def test_transformer_engine_extra_state_is_checked_before_te_unpickles_it(tmp_path):
    """TE's FP8 extra state is a pickle inside a tensor, which every earlier check passes as
    data and TE's set_extra_state unpickles with no allowlist: a crafted one is refused at
    load, naming the key, and never runs; TE's own state loads."""
    marker = tmp_path / "ran"
    (refusal,) = run_distributed(_extra_state_round_trip, 1, str(tmp_path / "bad"), str(marker))
    assert "decoder.layers.0.mlp.linear_fc1._extra_state" in refusal
    assert "its pickle names" in refusal and "nothing of it was run" in refusal
    assert not marker.exists()
    (read,) = run_distributed(_extra_state_round_trip, 1, str(tmp_path / "good"), None)
    assert len(read) == 1 and read[0]["extra_fp8_variables"] == {"num_gemms": 1}
    assert torch.equal(read[0]["scale_fwd"], torch.ones(3))
