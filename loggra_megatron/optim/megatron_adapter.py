"""LoGRA inside Megatron-Core's optimizers: the one module that touches their internals.

:func:`get_loggra_optimizer` builds Megatron's own optimizer with
``megatron.core.optimizer.get_megatron_optimizer`` (so grad buffers, reduce-scatter,
fp32 main params, loss scaling, grad clipping, NaN skipping, ``overlap_grad_reduce`` /
``overlap_param_gather`` and the ``OptimizerParamScheduler`` all stay Megatron's) and then
replaces the inner ``torch.optim.AdamW`` of each leaf optimizer with a
:class:`~loggra_megatron.optim.distributed.ShardedLoGRAAdamW` over the *same* param
groups (Megatron's ``wd_mult``/``lr_mult`` keys included):

* ``DistributedOptimizer`` (``use_distributed_optimizer=True``, the target): the inner
  params are the DP rank's 1-D slices of each weight; their layouts (which flat range
  each DP rank holds) are recomputed from the grad buffers' bucket split, exactly as
  Megatron computes them, and checked against Megatron's own range map.
* ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``: the inner params are whole
  weights, replicated over DP; every DP rank computes the same update.

Embeddings, the output layer, norms, biases and matrices with a side shorter than
``loggra_min_dim`` are updated by dense AdamW inside the same inner optimizer. Leaf
optimizers (and a ``ChainedOptimizer``) are re-classed to the ``LoGRA*`` subclasses of
:mod:`loggra_megatron.optim.leaves`, which save the sketch state with ``dist_checkpointing``
and hand bf16 gradients to LoGRA without Megatron's fp32 copy.

Pinned to megatron-core 0.16 (Python 3.11) – 0.19; the attributes used
(``buffers``, ``param_index_map``, ``buckets[i].offset``, ``model_*_groups`` /
``shard_*_groups``, ``float16_groups`` / ``fp32_from_*_groups``) are covered by tests.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer

from loggra_megatron.optim.distributed import ShardedLoGRAAdamW, WeightLayout
from loggra_megatron.optim.loggra_adamw import LoGRAAdamW, basis_seed
from loggra_megatron.optim.projection import PROJECTIONS

DENSE_NAME_PARTS = ("embedding", "output_layer")
"""Parameters whose name contains one of these are never sketched."""


@dataclass
class LoGRAOptimizerConfig(OptimizerConfig):
    """Megatron ``OptimizerConfig`` plus LoGRA's settings (``optimizer`` must be ``"adam"``;
    Adam's betas, eps, weight decay and lr come from the base fields)."""

    loggra_rank: int = 128
    """Sketch rank r per weight (clamped to ``min(m, n)`` with one warning)."""
    loggra_update_interval: int = 200
    """Optimizer steps between basis refreshes."""
    loggra_projection: str = "range_finder"
    """``range_finder`` | ``svd`` (GaLore baseline: exact top-r subspace from the all-reduced
    Gram matrix, ``n²`` floats per weight per refresh) | ``random`` | ``identity``."""
    loggra_oversample: int = 8
    """Extra range-finder probe vectors p."""
    loggra_power_iters: int = 1
    """Range-finder power iterations q."""
    loggra_scale: float = 1.0
    """α, multiplies the low-rank update."""
    loggra_min_dim: int = 64
    """Matrices with a (TP-local) side shorter than this are updated densely."""
    loggra_seed: int = 0
    """Base seed of the range finder's Gaussian test matrices."""
    loggra_fp32_grad_copy: bool = False
    """Let Megatron copy all bf16 gradient shards to fp32 before the step (4 bytes per
    parameter); by default LoGRA converts them one weight at a time (``model_grads.py``)."""

    def __post_init__(self):
        super().__post_init__()
        if self.optimizer != "adam":
            raise ValueError(f"LoGRAOptimizerConfig: optimizer={self.optimizer!r}; LoGRA is Adam")
        if self.loggra_projection not in PROJECTIONS:
            raise ValueError(
                f"LoGRAOptimizerConfig: invalid loggra_projection={self.loggra_projection!r}: "
                f"choose one of {', '.join(PROJECTIONS)}"
            )
        LoGRAAdamW([torch.zeros(1)], **self.loggra_kwargs())  # raises ValueError naming the field

    def loggra_kwargs(self) -> dict:
        """Keyword arguments for LoGRAAdamW (field names without the ``loggra_`` prefix)."""
        return dict(
            lr=self.lr if self.lr is not None else 0.0,
            betas=(self.adam_beta1, self.adam_beta2),
            eps=self.adam_eps,
            weight_decay=self.weight_decay,
            rank=self.loggra_rank,
            update_interval=self.loggra_update_interval,
            projection=self.loggra_projection,
            oversample=self.loggra_oversample,
            power_iters=self.loggra_power_iters,
            scale=self.loggra_scale,
            min_dim=self.loggra_min_dim,
            seed=self.loggra_seed,
        )


def get_loggra_optimizer(config: LoGRAOptimizerConfig, model_chunks: list, **kwargs):
    """A Megatron-Core optimizer for DDP-wrapped ``model_chunks`` with LoGRA inside.

    ``kwargs`` go to ``megatron.core.optimizer.get_megatron_optimizer``. Returns what it
    returns (a leaf optimizer or a ``ChainedOptimizer``), with each leaf's inner optimizer
    replaced by ``ShardedLoGRAAdamW``.
    """
    from loggra_megatron.optim.leaves import loggra_class_for

    optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    info = _ParamInfo(model_chunks)
    clamped: list[tuple[int, int]] = []
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(leaf, "optimizer", None) is None:
            continue  # a stub optimizer (no trainable params on this rank)
        if isinstance(leaf, DistributedOptimizer):
            pairs, ranges, layouts, dp_group = _distributed_layouts(leaf, config, info, clamped)
        else:
            pairs, ranges, layouts, dp_group = _replicated_layouts(leaf, config, info, clamped)
        held = {w: main for w, (model_param, main) in enumerate(pairs) if w in layouts}
        all_layouts = [layouts[w] for w in sorted(layouts)]
        index = {w: i for i, w in enumerate(sorted(layouts))}
        leaf.optimizer = ShardedLoGRAAdamW(
            leaf.optimizer.param_groups,
            all_layouts=all_layouts,
            held={index[w]: p for w, p in held.items() if p is not None},
            dp_rank=dp_group.rank() if dp_group is not None else 0,
            dp_group=dp_group,
            tp_dp_group=_tp_dp_group(dp_group),
            consensus_group=leaf.get_grad_stats_parallel_group(),
            **config.loggra_kwargs(),
        )
        leaf.loggra_params = [
            (info.key(mp), mp, main, ranges[w])
            for w, (mp, main) in enumerate(pairs)
            if main is not None
        ]
        leaf.__class__ = loggra_class_for(type(leaf))
    if type(optimizer) is ChainedOptimizer:
        optimizer.__class__ = loggra_class_for(ChainedOptimizer)
    if clamped:
        warnings.warn(
            f"loggra_rank={config.loggra_rank} exceeds min(m, n) of {len(clamped)} weights "
            f"(e.g. {clamped[0]}); their rank is clamped to min(m, n).",
            stacklevel=2,
        )
    return optimizer


class _ParamInfo:
    """Names and seeds of model params, independent of TP/DP (same on every rank)."""

    def __init__(self, model_chunks):
        self.gated = getattr(model_chunks[0].config, "gated_linear_unit", False)
        self.names, self.seeds = {}, {}
        for c, chunk in enumerate(model_chunks):
            for name, p in chunk.named_parameters():
                self.names[p] = f"chunk{c}.{name.removeprefix('module.')}"
                self.seeds[p] = len(self.seeds)

    def key(self, p) -> str:
        return self.names[p]

    def is_glu_fc1(self, p) -> bool:
        return self.gated and self.names.get(p, "").endswith("linear_fc1.weight")

    def sketched(self, p, config) -> bool:
        name = self.names.get(p, "")
        return (
            p.dim() == 2
            and not any(part in name for part in DENSE_NAME_PARTS)
            and (config.loggra_projection == "identity" or min(p.shape) >= config.loggra_min_dim)
        )


def _layout(p, dp_ranges, config, info, clamped) -> WeightLayout:
    """The layout of sketched model param ``p`` (TP-local ``[m, n]``)."""
    m, n = p.shape
    rank = n if config.loggra_projection == "identity" else min(config.loggra_rank, m, n)
    if config.loggra_projection != "identity" and rank < config.loggra_rank:
        clamped.append((m, n))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    column_parallel = (
        tp > 1
        and getattr(p, "tensor_model_parallel", False)
        and getattr(p, "partition_dim", -1) == 0
    )
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return WeightLayout(
        shape=(m, n),
        rank=rank,
        seed=basis_seed(config.loggra_seed, info.seeds[p]),
        dp_ranges=tuple(dp_ranges),
        row_offset=tp_rank * m if column_parallel else 0,
        global_rows=tp * m if column_parallel else m,
        reduce_over_tp=column_parallel,
        glu_halves=column_parallel and info.is_glu_fc1(p),
    )


def main_params_of(leaf) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """``(main param, model param, start, end)`` for each main param of a Megatron leaf
    optimizer: the main param holds ``model_param.view(-1)[start:end]`` in fp32 (for fp32
    model params it *is* that view)."""
    if isinstance(leaf, DistributedOptimizer):
        groups = [
            *zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups, strict=True),
            *zip(leaf.model_fp32_groups, leaf.shard_fp32_groups, strict=True),
        ]
        out = []
        for model_group, main_group in groups:
            for model, main in zip(model_group, main_group, strict=True):
                r = leaf._get_model_param_range_map(model)["param"]
                out.append((main, model, r.start, r.end))
        return out
    if hasattr(leaf, "float16_groups"):  # Float16OptimizerWithFloat16Params
        groups = [
            *zip(leaf.float16_groups, leaf.fp32_from_float16_groups, strict=True),
            *zip(leaf.fp32_from_fp32_groups, leaf.fp32_from_fp32_groups, strict=True),
        ]
    else:  # FP32Optimizer: the model params are the main params
        groups = [(g["params"], g["params"]) for g in leaf.optimizer.param_groups]
    return [
        (main, model, 0, model.numel())
        for model_group, main_group in groups
        for model, main in zip(model_group, main_group, strict=True)
    ]


def _distributed_layouts(leaf, config, info, clamped):
    """(model, main-shard) pairs in Megatron's grad-buffer order, layouts of sketched ones."""
    main_of = {model: (main, start, end) for main, model, start, end in main_params_of(leaf)}
    dp = leaf.data_parallel_group.size()
    dp_rank = leaf.data_parallel_group.rank()
    pairs, own_ranges, layouts = [], [], {}
    for buffer in leaf.buffers:
        for p, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            chunk = bucket.grad_data.numel() // dp
            ranges = []
            for r in range(dp):
                lo = max(start, bucket.offset + r * chunk)
                hi = min(end, bucket.offset + (r + 1) * chunk)
                ranges.append((lo - start, hi - start) if hi > lo else (0, 0))
            main, *megatron_range = main_of.get(p, (None, None, None))
            if main is not None:
                assert tuple(megatron_range) == ranges[dp_rank], (
                    "LoGRA's DP layout disagrees with Megatron's; unsupported megatron-core?"
                )
            if info.sketched(p, config):
                layouts[len(pairs)] = _layout(p, ranges, config, info, clamped)
            pairs.append((p, main))
            own_ranges.append(ranges[dp_rank])
    return pairs, own_ranges, layouts, leaf.data_parallel_group


def _replicated_layouts(leaf, config, info, clamped):
    pairs = [(model, main) for main, model, _, _ in main_params_of(leaf)]
    layouts = {
        w: _layout(p, [(0, p.numel())], config, info, clamped)
        for w, (p, _) in enumerate(pairs)
        if info.sketched(p, config)
    }
    return pairs, [(0, p.numel()) for p, _ in pairs], layouts, None


def _tp_dp_group(dp_group):
    """The group spanning TP × (this optimizer's) DP, for column-parallel bases. Megatron's
    distributed optimizer shards over DP × CP, hence ``with_context_parallel=True``."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return dp_group
    if dp_group is None:
        return parallel_state.get_tensor_model_parallel_group()
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
