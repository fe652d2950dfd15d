"""The trainer's weight sync to the generation ranks (collective over the training world).

``--weight-sync full``: every weight, as Hugging Face tensors in byte buckets
(``placement.weights``). ``--weight-sync lowrank`` (the backward sketch): the first sync is a
full one plus the masters of the sketched weights (``placement.lowrank.RowMaster``); every
later one sends the other trained weights in full (none when they are frozen,
``--freeze-non-targets``) and, for the sketched ones, the row updates committed since
(``RowUpdate``: ``D``, the rate, the draw), which the generation ranks apply to their copy of
the masters. Either way, with a checksum due, the trainer's digest of all its weights goes
last, and the generation ranks compare it with their own.
"""

from __future__ import annotations

import torch.distributed as dist

from loggra_megatron.placement.channel import Bucket, PeerLost, Weights, WeightsEnd
from loggra_megatron.placement.row_records import (
    row_masters,
    sketch_leaf,
    start_recording,
    take_row_updates,
)
from loggra_megatron.placement.weights import digest, pack_buckets

__all__ = ["WeightSender"]


class WeightSender:
    """Sends the trainer's weights (``channel``: the leader's end; None elsewhere)."""

    def __init__(self, channel, model_args, placement_cfg, optimizer):
        self.channel, self.model_args, self.cfg = channel, model_args, placement_cfg
        self.leaf = sketch_leaf(optimizer) if placement_cfg.weight_sync == "lowrank" else None
        if self.leaf is not None:
            start_recording(self.leaf)
        self.full_next = True
        """The next sync is a full one (the first)."""

    def send(self, policy, version: int, check: bool) -> tuple[int, str | None]:
        """One sync; returns the bytes the leader sent (0 elsewhere) and the failure to
        share with the training world (None: none)."""
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model

        full, self.full_next = self.full_next, False
        model = unwrap_model(policy)
        records = self._gather_records(full)  # collective over the training world
        if ps.get_data_parallel_rank() != 0:
            return 0, None
        select = None if full or self.leaf is None else self._dense_only()
        before = self.channel.bytes_sent if self.channel is not None else 0
        failure = self._stream(model, version, check, full, select, records)
        sent = self.channel.bytes_sent - before if self.channel is not None else 0
        return sent, failure

    def _dense_only(self):
        """The trained weights that are not sketched (the sketched ones travel as updates)."""
        sketched = {id(site.weight) for sites in self.leaf.sites for site in sites}
        return lambda name, p: id(p) not in sketched and p.requires_grad

    def _gather_records(self, full: bool) -> list | None:
        """The low-rank records of every training rank, on the leader (collective)."""
        if self.leaf is None:
            return None
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        mine = row_masters(self.leaf, tp_rank) if full else take_row_updates(self.leaf, tp_rank)
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return None if gathered is None else [r for part in gathered for r in part]

    def _hf_tensors(self, model, select):
        """The Hugging Face tensors of every pipeline stage, in stage order, on the leader;
        elsewhere an iterator that takes part in the gathers and yields nothing (exhaust
        it). One stage: streamed (a TP collective per parameter); several: each stage's
        TP rank 0 gathers its stage's tensors to the leader (host copies)."""
        from megatron.core import parallel_state as ps

        from loggra_megatron.convert.megatron_to_hf import iter_hf_tensors

        tensors = iter_hf_tensors(model, self.model_args, select)
        stages = ps.get_pipeline_model_parallel_world_size()
        if stages == 1:
            return tensors
        mine = [(name, t.cpu()) for name, t in tensors]
        if ps.get_tensor_model_parallel_rank() != 0:
            return iter(())
        group = ps.get_pipeline_model_parallel_group()
        gathered = [None] * stages if ps.get_pipeline_model_parallel_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0), group=group)
        return iter([] if gathered is None else [x for stage in gathered for x in stage])

    def _stream(self, model, version, check, full, select, records) -> str | None:
        """Collects the weights (on data-parallel replica 0); the leader sends them, then
        the records and the digest."""
        tensors, kept = self._hf_tensors(model, select), []
        if self.channel is None:  # another rank of replica 0: take part in the gathers
            for _ in tensors:
                pass
            if check and select is not None:
                for _ in self._hf_tensors(model, None):
                    pass
            return None
        bucket_bytes = self.cfg.weight_sync_bucket_mb * 2**20
        try:
            self.channel.send(Weights(version))
            for specs, raw in pack_buckets(_keep(tensors, kept, check), bucket_bytes):
                self.channel.send(Bucket(specs, raw.numel()))
                self.channel.send_tensor(raw)
            if check and select is not None:  # the digest is of every weight
                kept = list(self._hf_tensors(model, None))
            end = WeightsEnd(digest(kept) if check else None)
            if records is not None:
                end.row_masters, end.row_updates = (records, None) if full else (None, records)
            self.channel.send(end)
        except PeerLost as e:
            return str(e)
        return None


def _keep(tensors, kept: list, check: bool):
    for name, t in tensors:
        if check:
            kept.append((name, t))
        yield name, t
