"""Saving with --loggra-param-remainders: the fp32 masters are rebuilt into host copies one
bucket at a time (``optim/megatron/checkpoint.py``), and the files are those of the masters.

* The checkpoint's tensor files are byte for byte those of a save whose ``fp32_param``
  entries hold a straightforward reference master (``B·2¹⁶ + d`` in int64) of every weight.
* Beyond the live state, no set of fp32/int32 tensors alive at once during the whole save
  (``dist_ckpt.save_checkpoint``: ``sharded_state_dict``, ``dist_checkpointing.save``)
  exceeds one bucket's bytes (``param_remainders.copy_transient_bytes``), leaving out the
  host copies themselves, Megatron's writer staging every tensor on the host and the finite
  check's temporaries (one tensor at a time, any tensor: ``checkpointing/integrity.py``);
  rebuilding every master at once, as the save did before, is caught by the same measure.

Both LoGRA sketches at DP=2 (gloo): ``--loggra-sketch gradient`` (the ``LoGRA*`` leaves) and
``backward`` (its row optimizer, plus the dense leaves).
"""

import filecmp
import os

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

HIDDEN, HEADS, VOCAB, SEQ = 32, 4, 64, 8
BUCKET = 64
"""Elements per bucket in these saves: every master spans several, the last one partial."""
TOKENS = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))


class AllocationTracker(TorchDispatchMode):
    """Every fp32/int32 storage created by an op while active (not a view or an in-place
    result of its inputs): its bytes and the op counts at which it was created and found
    freed. Storages passed to ``exclude`` and ops run through ``paused`` are left
    out of ``peak_bytes``."""

    def __init__(self):
        super().__init__()
        self.clock = 0
        self.records = []  # [weak ref, bytes, created, freed or None, excluded]
        self.live = {}  # storage id → record
        self.pause_depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        inputs = {
            t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)
        }
        out = func(*args, **(kwargs or {}))
        self.clock += 1
        if not self.pause_depth:
            for t in tree_leaves(out):
                if torch.is_tensor(t) and t.dtype in (torch.float32, torch.int32):
                    storage = t.untyped_storage()
                    if storage._cdata not in inputs and storage._cdata not in self.live:
                        record = [
                            StorageWeakRef(storage),
                            storage.nbytes(),
                            self.clock,
                            None,
                            False,
                        ]
                        self.records.append(record)
                        self.live[storage._cdata] = record
        self.clock += 1
        return out

    def _sweep(self) -> None:
        for key, record in list(self.live.items()):
            if record[0].expired():
                record[3] = self.clock
                del self.live[key]

    def exclude(self, tensor: torch.Tensor) -> None:
        self.live[tensor.untyped_storage()._cdata][4] = True

    def paused(self, fn, *args, **kwargs):
        self.pause_depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.pause_depth -= 1

    def peak_bytes(self) -> int:
        """The most bytes of tracked, not excluded storages alive at once (those still alive
        count until now)."""
        self._sweep()
        events = []
        for _, nbytes, created, freed, excluded in self.records:
            if not excluded:
                events += [(created, nbytes), (self.clock if freed is None else freed, -nbytes)]
        peak = total = 0
        for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # frees first
            total += change
            peak = max(peak, total)
        return peak


def test_join_master_into_rebuilds_the_master_bucket_by_bucket():
    from loggra_megatron.optim.param_remainders import join_master_into, store_master

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(1000, generator=gen) * torch.logspace(-20, 20, 1000)
    weight = torch.empty(1000, dtype=torch.bfloat16)
    remainder = torch.empty(1000, dtype=torch.int16)
    store_master(weight, remainder, master.clone())
    for bucket_numel in (7, 1000, 4096):  # a partial last bucket, one, more than all
        out = torch.full((1000,), float("nan"))
        assert join_master_into(weight, remainder, out, bucket_numel) is out
        assert torch.equal(out.view(torch.int32), master.view(torch.int32))
    with pytest.raises(TypeError, match="fp32 master, not torch.float64"):
        join_master_into(weight, remainder, torch.empty(1000, dtype=torch.float64), 7)


def _reference_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master ``u = B·2¹⁶ + d`` of bf16 ``weight`` and int16 ``remainder``, computed
    in int64 (no wrapping), as a flat tensor of its own."""
    bits = weight.detach().view(torch.int16).to(torch.int64) * 2**16 + remainder.to(torch.int64)
    assert bool(((bits >= -(2**31)) & (bits < 2**31)).all())
    return bits.to(torch.int32).view(torch.float32).reshape(-1).clone()


def _trained(sketch: str):
    """A bf16 GPT with remainders after two training steps, and its optimizer."""
    from megatron.core import parallel_state

    from loggra_megatron.optim.config import LoGRAConfig, OptimConfig
    from loggra_megatron.optim.megatron.factory import build_loggra, prepare_model
    from loggra_megatron.testing import tiny_bf16_gpt_model, train_step, wrap_ddp

    model = tiny_bf16_gpt_model(num_layers=2, hidden_size=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ)
    optim = OptimConfig(optimizer="loggra", lr=3e-2, weight_decay=0.1)
    by_sketch = {"gradient": {"loggra_min_dim": 1}, "backward": {}}[sketch]
    loggra = LoGRAConfig(
        loggra_sketch=sketch,
        loggra_rank=4,
        loggra_seed=7,
        loggra_param_remainders=True,
        **by_sketch,
    )
    sites = prepare_model(model, optim, loggra)  # None with the gradient sketch
    ddp = wrap_ddp(model, grad_reduce_in_fp32=False)
    opt = build_loggra(optim, loggra, [ddp], [sites])
    dp = parallel_state.get_data_parallel_world_size()
    batch = TOKENS[parallel_state.get_data_parallel_rank() :: dp]
    for _ in range(2):
        assert train_step(ddp, opt, batch, num_microbatches=batch.shape[0])[1][0]
    return ddp, opt


def _remainders(opt) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(main, remainder)`` of every master kept as a remainder, over the leaves."""
    leaves = getattr(opt, "chained_optimizers", [opt])
    return [(m, r) for leaf in leaves for m, r in leaf.optimizer.param_remainders.items()]


def _measured_save(rank, root: str, sketch: str):
    """Save the same state twice: the reference (``fp32_param`` = the int64 reference
    master) and the code's, the latter measured by ``AllocationTracker``."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from loggra_megatron.checkpointing import integrity, save_checkpoint
    from loggra_megatron.optim.megatron import backward_optimizer, checkpoint
    from loggra_megatron.optim.param_remainders import copy_transient_bytes, join_master

    ddp, opt = _trained(sketch)
    remainders = _remainders(opt)
    measured_master = checkpoint.checkpoint_master

    def reference_master(inner, main, is_loading):
        remainder = inner.param_remainders.get(main)
        if remainder is None:
            return measured_master(inner, main, is_loading)
        return _reference_master(main, remainder)

    for module in (checkpoint, backward_optimizer):
        module.checkpoint_master = reference_master
    save_checkpoint(os.path.join(root, "reference"), 2, [ddp], opt, common={"step": 2})
    for module in (checkpoint, backward_optimizer):
        module.checkpoint_master = measured_master

    tracker, host_copies = AllocationTracker(), []
    checkpoint.COPY_BUCKET_NUMEL = BUCKET
    fill = checkpoint.join_master_into

    def fill_host_copy(weight, remainder, out, bucket_numel):
        tracker.exclude(out)
        host_copies.append((out.device.type, out.numel()))
        return fill(weight, remainder, out, bucket_numel)

    checkpoint.join_master_into = fill_host_copy
    stage = FileSystemWriterAsync.prepare_write_data  # Megatron's writer: host copies
    FileSystemWriterAsync.prepare_write_data = lambda self, *a: tracker.paused(stage, self, *a)
    check = integrity.nonfinite_tensors  # isfinite: a temporary per tensor, every tensor
    integrity.nonfinite_tensors = lambda state: tracker.paused(check, state)
    with tracker:
        save_checkpoint(os.path.join(root, "saved"), 2, [ddp], opt, common={"step": 2})
    FileSystemWriterAsync.prepare_write_data = stage
    integrity.nonfinite_tensors = check

    all_at_once = AllocationTracker()  # the former save: every master rebuilt, then written
    with all_at_once:
        masters = [join_master(m.detach(), r) for m, r in remainders]
    return {
        "peak": tracker.peak_bytes(),
        "bound": copy_transient_bytes(BUCKET),
        "host_copies": host_copies,
        "masters_numel": sorted(m.numel() for m, _ in remainders),
        "all_at_once_peak": all_at_once.peak_bytes(),
        "all_masters_bytes": sum(4 * m.numel() for m in masters),
    }


def _tensor_files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".distcp") or f == "common.pt")


@pytest.mark.parametrize("sketch", ["gradient", "backward"])
def test_save_rebuilds_masters_bucket_by_bucket_into_the_same_files(tmp_path, sketch):
    from torch.distributed.checkpoint import FileSystemReader

    results = run_distributed(_measured_save, 2, str(tmp_path), sketch)
    for r in results:
        assert r["masters_numel"] and max(r["masters_numel"]) > 2 * BUCKET
        # one host copy per master kept as a remainder, of its size
        assert sorted(n for _, n in r["host_copies"]) == r["masters_numel"]
        assert {device for device, _ in r["host_copies"]} == {"cpu"}
        assert 0 < r["peak"] <= r["bound"] == 4 * BUCKET
        # the measure catches the former all-at-once rebuild
        assert r["all_at_once_peak"] == r["all_masters_bytes"] > 8 * r["bound"]
    saved, reference = (tmp_path / name / "iter_0000002" for name in ("saved", "reference"))
    files = _tensor_files(saved)
    assert files == _tensor_files(reference) and sum(f.endswith(".distcp") for f in files) >= 2
    for name in files:
        assert filecmp.cmp(saved / name, reference / name, shallow=False), name
    metadata = [FileSystemReader(str(d)).read_metadata() for d in (saved, reference)]
    assert metadata[0].state_dict_metadata == metadata[1].state_dict_metadata
    assert metadata[0].storage_data == metadata[1].storage_data
    assert any(k.endswith("fp32_param") for k in metadata[0].state_dict_metadata)
