"""The backward sketch's weight sync over DP: the rows of a model chunk's targets in flat
buffers of at most ``ROW_GATHER_BUCKET_NUMEL`` elements, one all-gather each, pipelined
under ``--overlap-param-gather``.

Sharding. Under the distributed optimizer DP rank ``d`` updates rows
``[d·k, min((d+1)·k, m))`` of every target weight ``W`` (``[m, n]`` on this TP rank,
``k = ⌈m/D⌉``, ``D`` the DP size: ``SketchSite.owned_rows``). After an update a rank holds new
values of its own rows only; the sync copies every other rank's rows into its weights.

Buckets. The chunk's targets, in ``SketchSites`` order, are cut into consecutive buckets of at
most ``ROW_GATHER_BUCKET_NUMEL`` gathered elements (40M, Megatron-LM's default DDP bucket size;
a larger target is a bucket of its own; ``row_gathers``). The bucket bounds the transient
buffer below.

Layout. A bucket's buffer is ``[D, E]`` in the weights' dtype, ``E = Σ k·n`` over its
targets: segment ``d`` holds DP rank ``d``'s rows of each target, each padded to ``k`` rows
(zeros where ``m`` is not a multiple of ``D``, and for a rank that owns no rows). A rank
copies its rows into its own segment; one ``all_gather_into_tensor`` whose input is that
segment (a view of the output, as Megatron's DDP gathers its param buckets) fills the others;
the other segments' rows are copied back into the weights. A rank's own rows are never written
back. Both steps are copies: the weights are bit for bit those of one all-gather per weight
(``gather_rows_per_weight``, the former path, kept as the reference).

Bytes per sync and rank (ring, ``b`` bytes per element): ``(D−1)/D · D·E·b = (D−1)·E·b`` per
bucket, exactly the per-weight path's ``Σ (D−1)·k·n·b`` (it gathers each weight's padded
``[D·k, n]``), in one collective per bucket instead of one per target (4 per layer). An
optimizer step syncs once; a predicted-KL step once per trial and once at the commit or
restore.

Overlap (``overlap_param_gather`` of the model's DDP config, ``--overlap-param-gather``):
``sync_buckets`` issues bucket ``i + 1``'s all-gather before it waits for bucket ``i`` and
copies its rows back, so the copies of one bucket run under the next one's communication: two
buffers at most (``D·E·b`` each). Every gather is finished when the sync returns. Leaving them
in flight until the targets' next forward, as Megatron's DDP does with its persistent param
buffers, would hold every bucket's buffer across the step: a second copy of the targets'
weights (5.97 GiB per GPU for the 27B example at DP 8, by the memory estimator) for a sync
of about 5 GB of NVLink traffic there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loggra_megatron.optim.megatron.backward_sites import SketchSite, SketchSites


def row_gathers(sites: SketchSites, segment: int, group, bucket_numel: int | None) -> list:
    """The ``RowGather`` buckets of one model chunk: its targets in order, a new bucket
    whenever the gathered elements (``D·Σ k·n``) would pass ``bucket_numel`` (a larger
    target is a bucket of its own); one bucket for all of them when it is None."""
    buckets: list[list[SketchSite]] = [[]]
    numel = 0
    for site in sites:
        size = sites.segments * site.chunk * site.cols
        if buckets[-1] and bucket_numel is not None and numel + size > bucket_numel:
            buckets.append([])
            numel = 0
        buckets[-1].append(site)
        numel += size
    return [RowGather(bucket, sites.segments, segment, group) for bucket in buckets]


class RowGather:
    """The weight sync of one bucket of a model chunk's targets (module docstring).

    Args:
        sites: the targets, in the chunk's ``SketchSites`` order.
        segments: the DP size (``SketchSites.segments``).
        segment: this rank's DP segment.
        group: the DP group (with context parallelism) the rows are split over.
    """

    def __init__(self, sites: list[SketchSite], segments: int, segment: int, group):
        self.sites = sites
        self.segments = segments
        self.segment = segment
        self.group = group
        weights = [site.weight for site in self.sites]
        self.dtype, self.device = weights[0].dtype, weights[0].device
        if any(w.dtype != self.dtype or w.device != self.device for w in weights):
            raise ValueError(
                "--loggra-sketch backward: the targets of a model chunk have different dtypes "
                "or devices; their rows cannot share one all-gather bucket"
            )
        self.offsets: list[int] = []
        """Each target's first element in a segment of the buffer."""
        numel = 0
        for site in self.sites:
            self.offsets.append(numel)
            numel += site.chunk * site.cols
        self.segment_numel = numel
        """``E``: elements of one DP segment (each target's rows padded to ``k``)."""
        self._in_flight: tuple[object, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered buffer, ``D·E·b`` (what a ring all-gather counts)."""
        return self.segments * self.segment_numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def pending(self) -> bool:
        """Whether a gather was started and not finished (the other ranks' rows in this
        rank's weights are those of before it)."""
        return self._in_flight is not None

    def _blocks(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Target ``i``'s rows in every segment of ``buffer``: ``[D, k, n]`` (a view)."""
        site, start = self.sites[i], self.offsets[i]
        return buffer[:, start : start + site.chunk * site.cols].unflatten(1, (site.chunk, -1))

    @torch.no_grad()
    def start(self, async_op: bool = False) -> None:
        """Gather every rank's rows of the bucket's targets (collective). The gather in flight,
        if any, is finished first. ``async_op``: return once it is issued; ``finish``
        completes it."""
        self.finish()
        buffer = torch.empty(
            (self.segments, self.segment_numel), dtype=self.dtype, device=self.device
        )
        for i, site in enumerate(self.sites):
            lo, hi = site.owned_rows(self.segment)
            own = self._blocks(buffer, i)[self.segment]
            own[: hi - lo].copy_(site.weight.detach()[lo:hi])
            own[hi - lo :].zero_()
        work = dist.all_gather_into_tensor(
            buffer.view(-1), buffer[self.segment], group=self.group, async_op=async_op
        )
        self._in_flight = (work, buffer)
        if not async_op:
            self.finish()

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the gather in flight (if any) and copy the other ranks' rows into the
        weights."""
        if self._in_flight is None:
            return
        work, buffer = self._in_flight
        self._in_flight = None
        if work is not None:
            work.wait()
        mine = self.segment
        for i, site in enumerate(self.sites):
            blocks, weight = self._blocks(buffer, i), site.weight.detach()
            if site.chunk * self.segments == site.rows:  # equal blocks: two copies
                rows = weight.view(self.segments, site.chunk, site.cols)
                rows[:mine].copy_(blocks[:mine])
                rows[mine + 1 :].copy_(blocks[mine + 1 :])
                continue
            for d in range(self.segments):
                lo, hi = site.owned_rows(d)
                if d != mine and hi > lo:
                    weight[lo:hi].copy_(blocks[d, : hi - lo])


def sync_buckets(gathers: list[RowGather], pipelined: bool) -> None:
    """Every bucket's gather, finished on return (module docstring); ``pipelined``: bucket
    ``i + 1``'s all-gather is issued before bucket ``i`` is waited for and copied back."""
    if not pipelined:
        for gather in gathers:
            gather.start()
        return
    previous = None
    for gather in gathers:
        gather.start(async_op=True)
        if previous is not None:
            previous.finish()
        previous = gather
    if previous is not None:
        previous.finish()


@torch.no_grad()
def gather_rows_per_weight(sites: SketchSites, segment: int, group) -> None:
    """The former sync, one all-gather per target: in place when the DP ranks own equal
    blocks (the input a view of the output at this rank's offset), else through a padded
    ``[D·k, n]`` buffer. Every rank's rows end in every rank's weights, as ``RowGather``'s;
    kept as its reference (tests, ``benchmarks/dp_traffic.py``)."""
    for site in sites:
        weight = site.weight.detach()
        lo, hi = site.owned_rows(segment)
        if sites.segments * site.chunk == site.rows:
            dist.all_gather_into_tensor(weight, weight[lo:hi], group=group)
            continue
        out = weight.new_empty((sites.segments * site.chunk, site.cols))
        mine = weight.new_zeros((site.chunk, site.cols))
        mine[: hi - lo].copy_(weight[lo:hi])
        dist.all_gather_into_tensor(out, mine, group=group)
        weight.copy_(out[: site.rows])
