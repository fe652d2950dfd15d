"""Backward sketches inside a Megatron-Core ``GPTModel`` (``--loggra-sketch backward``).

``prepare_model`` runs before DDP wraps the policy. For every ``--loggra-targets`` linear
layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``; Megatron's
``ColumnParallelLinear`` / ``RowParallelLinear`` and their subclasses) it

* freezes the weight for autograd (``requires_grad=False``): Megatron then runs
  ``linear_with_frozen_weight`` (no weight gradient, the input is not saved for one), and DDP
  allocates no ``main_grad`` and not a byte of grad buffer for it;
* registers a forward hook that keeps ``P = X Bᵀ`` (``[tokens, r]``, activation dtype) and a
  hook on the layer's output gradient ``H`` that adds ``Hᵀ P / √r`` into the layer's rows of
  one flat fp32 buffer (``SketchSites``). Hooks run only in forwards that build a graph
  (training; under activation recompute in the recomputation), never in rollouts or
  log-prob forwards.

Sharding and communication (``W_local``: ``[m, n]`` on this TP rank, ``A = B/√r`` drawn
for the full input width, identically on every rank):

* TP, column-parallel (qkv, fc1: ``W_local = W[rows of this rank]``): the full ``A``;
  ``S_local = H_localᵀ P`` is this rank's rows of ``S``, no TP sum. Under sequence parallelism
  ``X`` holds this rank's tokens, so ``P`` (``r`` columns) is all-gathered along tokens.
* TP, row-parallel (proj, fc2: ``W_local = W[:, cols of this rank]``): the column block
  ``A[:, cols]``; ``X_local A_blockᵀ`` are partial sums of ``P``. Without SP every rank has
  all tokens' ``H`` and sketches ``Hᵀ P_partial``; with SP ``P`` is reduce-scattered along
  tokens to this rank's tokens of ``H``. Either way ``S`` is summed over TP once per step
  (``[m, r]``), by ``BackwardSketchOptimizer``: the buffer puts every segment's row-parallel
  rows after its column-parallel ones, so that sum is one all-reduce of one contiguous view
  per segment (``all_reduce_row_parallel``), whatever the number of layers.
  Per micro-batch TP traffic is ``tokens·r`` per layer; per step ``m·r``: never ``m·n``. The
  sequence-parallel collectives of ``P`` are issued asynchronously in the forward hook and
  waited for in the target's backward, where ``P`` is first read (the autograd node holds
  ``P``, the tensor sent and the pending work until then).
* DP: rows are cut in ``ceil(m / DP)`` blocks, segment ``d`` holding DP rank ``d``'s rows of
  every weight. ``--loggra-sketch-reduce step`` (as published): the buffer is
  ``[segments, rows per segment, r]`` on every rank and one ``reduce_scatter`` per update gives
  each rank the summed sketch of the rows it updates and keeps state for (one segment,
  all-reduced, without the distributed optimizer). ``microbatch``: the buffer is this rank's
  segment ``[1, rows per segment, r]`` only; each layer's ``[m, r]`` product is
  reduce-scattered by rows in its backward hook, every micro-batch (the ZeRO-2 trade:
  ``1/DP`` of the buffer for ``num_microbatches`` times the DP bytes).
* PP: each stage sketches its own layers. The projection of a layer is named by its global
  layer number, so PP=2 draws what PP=1 draws.

The projections of an update (``SketchSites.signs``): a Rademacher ``B`` is drawn once per
site and update, at its first use (the update's first hooked forward), and kept packed, one
bit per entry of this TP rank's block (``[r, ⌈n/8⌉]`` uint8: ``r·n/8`` bytes per target;
the 27B example, 64 layers × 4 targets at hidden 5120, FFN 22016, TP=8: 14 MB per GPU at
``r`` = 128, 28 MB at 256, against 223 and 447 MB in bf16). Every micro-batch's forward, a
recomputation, the update ratio's and ``‖Δθ‖²``'s Gram forms, each KL trial and the commit
unpack it (``±1`` exactly, in the dtype asked for; a transient of ``r·n`` bytes and the
result). It is dropped when the step ends (the optimizer sets ``updates``), so it is held
from the first training forward to the optimizer step and not in the rollouts after a
committed step. A Gaussian ``B`` has no compact form (2 bytes per entry in bf16, hundreds of
MB at that size): it is drawn at each use, as before. ``draws`` counts the draws.

Transformer Engine's fused ``LayerNormLinear`` is sketched from its normalized input
(``layer_input``). Megatron-Core / TE attributes read (pinned: megatron-core 0.16–0.19,
TE 2.x): ``weight.partition_dim``, ``module.sequence_parallel``,
``TransformerLayer.layer_number``; ``layer_norm_weight``, ``layer_norm_bias``,
``normalization``, ``zero_centered_gamma`` and ``eps`` of a ``LayerNormLinear``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from loggra_megatron.optim.backward_sketch.sketch import (
    draw_signs,
    fp32_matmul,
    pack_signs,
    sketch_scale,
    unpack_signs,
)


@dataclass
class SketchSite:
    """One target weight on this rank."""

    name: str
    """``layer{global layer number}.{target}``: names the projection's draw."""
    module: torch.nn.Module
    weight: torch.nn.Parameter
    column_parallel: bool
    sequence_parallel: bool
    rows: int
    """``m``: rows of the TP-local weight."""
    cols: int
    """``n``: columns of the TP-local weight."""
    full_cols: int
    """Columns of the whole weight (the width ``A`` is drawn for)."""
    col_offset: int
    """First column of this TP rank's block of ``A`` (row-parallel; 0 otherwise)."""
    offset: int = 0
    """First row of this weight in each DP segment of the buffer."""
    chunk: int = 0
    """Rows of this weight per DP segment (``ceil(rows / segments)``)."""

    def owned_rows(self, segment: int) -> tuple[int, int]:
        """The rows ``[lo, hi)`` of the weight that DP segment ``segment`` holds."""
        lo = min(segment * self.chunk, self.rows)
        return lo, min(lo + self.chunk, self.rows)


class SketchSites:
    """The target layers of one model chunk, their flat sketch buffer and projection.

    Args:
        model: the (unwrapped) model chunk.
        targets: target layer names (``--loggra-targets``).
        rank: sketch rank ``r`` (clamped to the narrowest target's full width).
        seed, kind, refresh_interval: the projection's draw (``--loggra-seed``,
            ``--loggra-sketch-matrix``, ``--loggra-refresh-interval``).
        segments: DP segments of the buffer (the DP size under the distributed optimizer,
            else 1).
        reduce: ``--loggra-sketch-reduce`` (``step`` or ``microbatch``; read with
            ``segments > 1``).
    """

    def __init__(self, model, targets, rank, seed, kind, refresh_interval, segments, reduce="step"):
        self.seed, self.kind, self.refresh_interval = seed, kind, refresh_interval
        self.segments = segments
        self.reduced_in_backward = segments > 1 and reduce == "microbatch"
        """Each layer's sketch is reduce-scattered over DP in its backward hook; the buffer
        holds this rank's segment only."""
        self.dp_group = (
            parallel_state.get_data_parallel_group(with_context_parallel=True)
            if self.reduced_in_backward
            else None
        )
        self._packed: dict[str, torch.Tensor] = {}
        """``{site name: B packed [r, ⌈n/8⌉] uint8}`` of this update (Rademacher)."""
        self.draws = 0
        """Projections drawn so far (``draw_signs`` calls; module docstring)."""
        self.async_collectives = True
        """Issue the forward hook's sequence-parallel collectives asynchronously."""
        self.updates = 0
        self.sites = list(_find_sites(model, targets))
        if not self.sites:
            raise ValueError(
                f"--loggra-sketch backward: no {'/'.join(targets)} layer in this model chunk"
            )
        self.rank = min(rank, *(s.full_cols for s in self.sites))
        if self.rank < rank:
            warnings.warn(
                f"--loggra-rank {rank} exceeds the input width of a target; the backward "
                f"sketch uses rank {self.rank}",
                stacklevel=2,
            )
        offset = 0
        for site in sorted(self.sites, key=lambda s: not s.column_parallel):  # stable
            site.chunk = math.ceil(site.rows / segments)
            site.offset, offset = offset, offset + site.chunk
        self.row_parallel_offset = min(
            (s.offset for s in self.sites if not s.column_parallel), default=offset
        )
        """First row of the row-parallel targets in each segment: they come last."""
        device = self.sites[0].weight.device
        held = 1 if self.reduced_in_backward else segments
        self.buffer = torch.zeros(held, offset, self.rank, dtype=torch.float32, device=device)
        """``[segments, rows per segment, r]`` fp32: every target's ``S`` (``[1, …]``: this
        rank's segment, summed over DP, when ``reduced_in_backward``)."""
        for site in self.sites:
            site.module.register_forward_hook(self._forward_hook(site))

    # ------------------------------------------------------------------ projection
    @property
    def updates(self) -> int:
        """Updates committed; the draw index is ``updates // refresh_interval``. Setting it
        (the optimizer does after each step, and on load) drops the update's projections."""
        return self._updates

    @updates.setter
    def updates(self, value: int) -> None:
        self._updates = value
        self._packed.clear()

    @property
    def draw(self) -> int:
        return self.updates // self.refresh_interval

    def signs(self, site: SketchSite, dtype=None) -> torch.Tensor:
        """``B`` of ``site`` for this draw, this TP rank's block: ``[r, n]`` in ``dtype``
        (default: the weight's), a new tensor (a Rademacher ``B`` unpacked from this update's
        bits, drawn at its first use; module docstring)."""
        dtype = dtype or site.weight.dtype
        if self.kind != "rademacher":
            return self._draw(site, dtype)
        packed = self._packed.get(site.name)
        if packed is None:
            packed = self._packed[site.name] = pack_signs(self._draw(site, torch.float32))
        return unpack_signs(packed, site.cols, dtype)

    def _draw(self, site: SketchSite, dtype) -> torch.Tensor:
        self.draws += 1
        full = draw_signs(
            self.kind,
            self.seed,
            self.draw,
            site.name,
            self.rank,
            site.full_cols,
            site.weight.device,
            dtype,
        )
        return full[:, site.col_offset : site.col_offset + site.cols]

    def signs_cache_bytes(self) -> int:
        """Bytes of the packed projections held now."""
        return sum(t.numel() for t in self._packed.values())

    # ------------------------------------------------------------------ the buffer
    def segment_view(self, segment: int) -> torch.Tensor:
        """DP segment ``segment`` of the buffer, ``[rows per segment, r]`` (a view; with
        ``reduced_in_backward`` the buffer holds this rank's segment only)."""
        return self.buffer[0 if self.reduced_in_backward else segment]

    def rows_view(self, site: SketchSite, segment: int) -> torch.Tensor:
        """``S`` rows of ``site`` held in ``segment``: ``[hi − lo, r]`` (a view)."""
        lo, hi = site.owned_rows(segment)
        return self.segment_view(segment)[site.offset : site.offset + hi - lo]

    def all_reduce_row_parallel(self, segment: int, group) -> None:
        """Sum the row-parallel targets' rows of ``segment`` over the TP ``group`` (their
        ``S`` was summed from column blocks): one all-reduce of one contiguous view (the
        segment's padding rows, zero, included); nothing at TP=1 or without such targets."""
        rows = self.segment_view(segment)[self.row_parallel_offset :]
        if rows.shape[0] and dist.get_world_size(group) > 1:
            dist.all_reduce(rows, group=group)

    @torch.no_grad()
    def _accumulate(self, site: SketchSite, grad_out: torch.Tensor, p: torch.Tensor) -> None:
        """``S += Hᵀ P / √r`` into ``site``'s rows (of every segment, or reduce-scattered)."""
        h = grad_out.reshape(-1, site.rows)
        product = fp32_matmul(h.t(), p.reshape(-1, self.rank).to(h.dtype))  # [m, r]
        product.mul_(sketch_scale(self.rank))
        if self.reduced_in_backward:
            self._reduce_scatter_into(site, product)
            return
        view = self.buffer[:, site.offset : site.offset + site.chunk]
        if site.chunk * self.segments == site.rows:
            view.add_(product.view(self.segments, site.chunk, self.rank))
            return
        for d in range(self.segments):
            lo, hi = site.owned_rows(d)
            view[d, : hi - lo].add_(product[lo:hi])

    def _reduce_scatter_into(self, site: SketchSite, product: torch.Tensor) -> None:
        """Sum ``product`` (``[m, r]``) over DP and add this rank's rows to its segment."""
        padded = site.chunk * self.segments
        if padded != site.rows:
            product = torch.cat([product, product.new_zeros(padded - site.rows, self.rank)])
        own = product.new_empty(site.chunk, self.rank)
        dist.reduce_scatter_tensor(own, product, group=self.dp_group)
        self.buffer[0, site.offset : site.offset + site.chunk].add_(own)

    def _forward_hook(self, site: SketchSite):
        tp_group = parallel_state.get_tensor_model_parallel_group()

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not (torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad):
                return None  # no backward follows (rollouts, log-probs, a checkpointed forward)
            with torch.no_grad():
                x = layer_input(module, args[0].detach())
                p = x.reshape(-1, site.cols) @ self.signs(site, x.dtype).t()  # [tokens, r]
                p = p.view(*x.shape[:-1], self.rank)
                pending = None
                if site.sequence_parallel:
                    collective = _gather_tokens if site.column_parallel else _scatter_sum
                    p, pending = collective(p, tp_group, self.async_collectives)
            tapped = _SketchTap.apply(
                out, p, lambda grad, kept: self._accumulate(site, grad, kept), pending
            )
            return (tapped, *output[1:]) if isinstance(output, tuple) else tapped

        return hook

    def zero(self) -> None:
        self.buffer.zero_()

    def __iter__(self) -> Iterator[SketchSite]:
        return iter(self.sites)


class _SketchTap(torch.autograd.Function):
    """The identity on a target's output whose backward hands the output gradient ``H`` and
    the kept ``P`` to ``accumulate``. The node holds ``P`` and ``pending`` (``(work, tensor
    sent)`` of the asynchronous collective that fills ``P``, or None) until its backward has
    waited for the work and used ``P``, then lets go of them; a graph dropped unused frees
    them with the node. (``P`` is not a saved tensor: waiting for the collective bumps its
    version.)"""

    @staticmethod
    def forward(ctx, out, p, accumulate, pending=None):
        ctx.p, ctx.accumulate, ctx.pending = p, accumulate, pending
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.pending is not None:
            ctx.pending[0].wait()
        p, ctx.p, ctx.pending = ctx.p, None, None
        ctx.accumulate(grad, p)
        return grad, None, None, None


def layer_input(module, x: torch.Tensor) -> torch.Tensor:
    """What the linear layer multiplies by its weight: ``x`` itself, or, for Transformer
    Engine's fused ``LayerNormLinear`` (Megatron's ``TELayerNormColumnParallelLinear``: the TE
    spec's ``linear_qkv`` and ``linear_fc1``, with the layer's own norm an ``IdentityOp``),
    the normalized ``x``, recomputed with TE's formula (fp32 statistics, ``(1 + γ)`` under
    ``zero_centered_gamma``, output in the input's dtype: TE 2.x ``_apply_normalization``). An
    FP8 layer is sketched from this high-precision input, never from its FP8 cast."""
    gamma = getattr(module, "layer_norm_weight", None)
    if gamma is None:
        return x
    xf, w = x.float(), gamma.float()
    if getattr(module, "zero_centered_gamma", False):
        w = w + 1
    if module.normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + module.eps)
    else:
        centered = xf - xf.mean(-1, keepdim=True)
        y = centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + module.eps)
    y = y * w
    bias = getattr(module, "layer_norm_bias", None)
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def _gather_tokens(p: torch.Tensor, group, async_op: bool = False):
    """All-gather ``p`` along its first (sequence) dimension over ``group``: ``(the gathered
    tensor, (work, tensor sent) or None)``; with ``async_op`` it is filled once work is
    waited for."""
    world, sent = dist.get_world_size(group), p.contiguous()
    out = p.new_empty((p.shape[0] * world, *p.shape[1:]))
    work = dist.all_gather_into_tensor(out, sent, group=group, async_op=async_op)
    return out, ((work, sent) if async_op else None)


def _scatter_sum(p: torch.Tensor, group, async_op: bool = False):
    """Sum ``p`` over ``group`` and keep this rank's block of the first dimension (the
    result as ``_gather_tokens``')."""
    world, sent = dist.get_world_size(group), p.contiguous()
    out = p.new_empty((p.shape[0] // world, *p.shape[1:]))
    work = dist.reduce_scatter_tensor(out, sent, group=group, async_op=async_op)
    return out, ((work, sent) if async_op else None)


def _find_sites(model, targets) -> Iterator[SketchSite]:
    """The target layers of ``model`` in module order, named by global layer number."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for layer in model.modules():
        number = getattr(layer, "layer_number", None)
        if number is None or not hasattr(layer, "mlp"):
            continue  # not a TransformerLayer
        for path, module in layer.named_modules():
            target = path.rpartition(".")[2]
            weight = getattr(module, "weight", None)
            if target not in targets or not isinstance(weight, torch.nn.Parameter):
                continue
            rows, cols = weight.shape
            column = getattr(weight, "partition_dim", 0) == 0
            split_cols = tp > 1 and not column
            yield SketchSite(
                name=f"layer{number}.{target}",
                module=module,
                weight=weight,
                column_parallel=column,
                sequence_parallel=bool(getattr(module, "sequence_parallel", False)) and tp > 1,
                rows=rows,
                cols=cols,
                full_cols=cols * tp if split_cols else cols,
                col_offset=tp_rank * cols if split_cols else 0,
            )


def prepare_model(model, optim, loggra) -> SketchSites:
    """Freeze ``--loggra-targets`` of ``model`` (before DDP wraps it) and install the
    backward sketch on them (the ``backward`` entry of ``SKETCH_MODES``); the sites, which the
    optimizer's builder takes (``factory.get_loggra_optimizer(..., sites=[...])``)."""
    config = model.config
    for module in model.modules():  # Float16Module → GPTModel
        if hasattr(module, "decoder") or hasattr(module, "embedding"):
            model = module
            break
    segments = (
        parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        if optim.use_distributed_optimizer
        else 1
    )
    sites = SketchSites(
        model,
        loggra.targets(),
        loggra.rank_for(config.hidden_size),
        loggra.loggra_seed or 0,
        loggra.loggra_sketch_matrix,
        loggra.loggra_refresh_interval,
        segments,
        loggra.loggra_sketch_reduce,
    )
    check_same_projection(sites)
    if loggra.freeze_non_targets:
        model.requires_grad_(False)
        embedding = getattr(model, "embedding", None)  # the first pipeline stage's
        if embedding is not None:
            embedding.register_forward_hook(_output_requires_grad)
    for site in sites:
        site.weight.requires_grad_(False)
    return sites


def _output_requires_grad(module, args, output):
    """A frozen embedding's output, made to require grad in a forward that builds a graph:
    with every weight before the first target frozen, nothing else would make the targets'
    outputs require grad, and no sketch would be formed."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


@torch.no_grad()
def check_same_projection(sites: SketchSites) -> None:
    """Every rank draws the first projection of the run (draw 0 of ``layer1``'s first target
    at ``sites``' width and rank) and compares it with every other rank's: the projections
    are never communicated, so ranks whose generators disagree (another torch build, another
    device type) would sum sketches of different matrices. One all-reduce of 2 numbers."""
    site = sites.sites[0]
    signs = draw_signs(
        sites.kind,
        sites.seed,
        0,
        f"layer1.{site.name.partition('.')[2]}",
        sites.rank,
        site.full_cols,
        site.weight.device,
        torch.float64,
    )
    weights = torch.arange(1, signs.numel() + 1, dtype=torch.float64, device=signs.device)
    digest = (signs.reshape(-1) * weights.remainder(977)).sum()
    extremes = torch.stack([digest, -digest])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if float(extremes[0]) != -float(extremes[1]):
        raise RuntimeError(
            f"--loggra-sketch backward: rank {dist.get_rank()} drew another first projection "
            "than other ranks (its digest "
            f"{float(digest)!r}, the ranks' range [{-float(extremes[1])!r}, "
            f"{float(extremes[0])!r}]): every rank must run the same torch build on the same "
            "device type, since the projections are drawn, never sent"
        )
