"""LoGRA inside Megatron-Core's optimizers, and the builders of the ``--optimizer`` registry.

``get_loggra_optimizer`` builds Megatron's own optimizer with
``megatron.core.optimizer.get_megatron_optimizer`` (so grad buffers, reduce-scatter,
fp32 main params, loss scaling, grad clipping, NaN skipping, ``overlap_grad_reduce`` /
``overlap_param_gather`` and the ``OptimizerParamScheduler`` all stay Megatron's) and then
replaces the inner ``torch.optim.AdamW`` of each leaf optimizer with a
``ShardedLoGRAAdamW`` over the *same* param
groups (Megatron's ``wd_mult``/``lr_mult`` keys included). The leaf optimizers are
re-classed to the ``LoGRA*`` subclasses of ``optim.megatron.leaves``.

Leaf optimizers, dense params, why re-classing, and the megatron-core attributes this is
pinned to (0.16–0.19): docs/optimizer.md#inside-megatron-cores-distributed-optimizer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer

from loggra_megatron.optim.config import LoGRAConfig, OptimConfig
from loggra_megatron.optim.gradient_sketch.adamw import basis_seed
from loggra_megatron.optim.gradient_sketch.distributed import ShardedLoGRAAdamW
from loggra_megatron.optim.gradient_sketch.projection import PROJECTIONS
from loggra_megatron.optim.gradient_sketch.weight_layout import WeightLayout
from loggra_megatron.optim.megatron.backward_optimizer import BackwardSketchOptimizer
from loggra_megatron.optim.megatron.gradient_energy import energy_slots_of
from loggra_megatron.optim.megatron.leaves import LoGRAChainedOptimizer, loggra_class_for
from loggra_megatron.optim.megatron.optimizer_state import install_state_init
from loggra_megatron.optim.megatron.params import keep_masters_as_remainders, main_params_of
from loggra_megatron.optim.registry import OPTIMIZERS, SKETCH_MODES, OptimizerSpec, resolve

DENSE_NAME_PARTS = ("embedding", "output_layer")
"""Parameters whose name contains one of these are never sketched."""


def check_loggra_settings(config: OptimizerConfig, loggra: LoGRAConfig) -> None:
    """Refuse LoGRA settings that Megatron's ``config`` cannot carry out (``ValueError``):
    LoGRA is Adam, and the fp32 masters kept as remainders need bf16 weights in the
    distributed optimizer without an fp32 gradient copy or Megatron's own master handling."""
    if config.optimizer != "adam":
        raise ValueError(f"get_loggra_optimizer: optimizer={config.optimizer!r}; LoGRA is Adam")
    if loggra.loggra_param_remainders and not (
        config.bf16
        and config.use_distributed_optimizer
        and not loggra.loggra_fp32_grad_copy
        and not config.log_num_zeros_in_grad
        and not config.use_precision_aware_optimizer
    ):
        raise ValueError(
            "--loggra-param-remainders needs bf16=True and use_distributed_optimizer=True, "
            "and excludes --loggra-fp32-grad-copy, log_num_zeros_in_grad and "
            "use_precision_aware_optimizer"
        )


def megatron_optimizer_config(optim: OptimConfig, model_chunks, **extra) -> OptimizerConfig:
    """Megatron's ``OptimizerConfig`` from the ``--optimizer`` section; bf16 main params
    follow the model's dtype."""
    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=bool(model_chunks[0].config.bf16),
        use_distributed_optimizer=optim.use_distributed_optimizer,
        overlap_param_gather_with_optimizer_step=False,
        **extra,
    )


def build_optimizer(
    spec: OptimizerSpec, optim: OptimConfig, loggra: LoGRAConfig, model_chunks, prepared=None
):
    """The Megatron optimizer of ``--optimizer`` registry entry ``spec``: its builder, and
    its ``init_state`` installed on every leaf (so a checkpoint loads before a step).
    ``prepared``: per chunk, what the entry's ``prepare_model`` returned (default: none)."""
    prepared = list(prepared) if prepared is not None else [None] * len(model_chunks)
    optimizer = resolve(spec.builder)(optim, loggra, model_chunks, prepared)
    if spec.init_state is not None:
        install_state_init(optimizer, resolve(spec.init_state))
    return optimizer


def prepare_model(model, optim: OptimConfig, loggra: LoGRAConfig):
    """The ``prepare_model`` of a sketching optimizer: its ``--loggra-sketch`` mode's (the
    backward sketch's sites), or ``None`` for a mode with nothing to prepare (or a dense
    ``optim.optimizer``)."""
    prepare = SKETCH_MODES[loggra.loggra_sketch].prepare_model
    if prepare is None or not OPTIMIZERS[optim.optimizer].sketched:
        return None
    return resolve(prepare)(model, optim, loggra)


def build_dense_adam(optim: OptimConfig, loggra: LoGRAConfig, model_chunks, prepared=None):
    """Megatron's own dense Adam (the ``adam`` entry of the optimizer registry)."""
    return get_megatron_optimizer(megatron_optimizer_config(optim, model_chunks), model_chunks)


def build_loggra(optim: OptimConfig, loggra: LoGRAConfig, model_chunks, prepared=None):
    """Megatron's optimizer with LoGRA inside (the ``loggra`` entry of the registry);
    ``prepared``: per chunk, what ``prepare_model`` returned."""
    return get_loggra_optimizer(
        megatron_optimizer_config(optim, model_chunks), model_chunks, loggra, sites=prepared
    )


def build_backward_sketch(
    config, loggra: LoGRAConfig, model_chunks, sites=None, **kwargs
) -> LoGRAChainedOptimizer:
    """``--loggra-sketch backward``'s optimizer: the chain of the dense leaves (Megatron's,
    ``kwargs`` to ``get_megatron_optimizer``; nothing sketched) and a
    ``BackwardSketchOptimizer`` over the targets of ``sites`` (what
    ``backward_sites.prepare_model`` returned for each chunk it froze)."""
    sites = [s for s in sites or () if s is not None]
    if not sites:
        raise ValueError(
            "--loggra-sketch backward (loggra_sketch='backward', the default): no sketch sites "
            "were given, so the targets would get dense gradients; call "
            "sites = prepare_model(model, optim, loggra) before DDP wraps the model and pass "
            "sites=[sites], or choose loggra_sketch='gradient'"
        )
    leaves = []
    if any(p.requires_grad for chunk in model_chunks for p in chunk.parameters()):
        dense = _megatron_optimizer_with_loggra(config, model_chunks, loggra, **kwargs)
        leaves = list(getattr(dense, "chained_optimizers", [dense]))
    sketch = BackwardSketchOptimizer(
        config, loggra, sites, model_chunks, _grad_stats_group(leaves, config)
    )
    return LoGRAChainedOptimizer([*leaves, sketch])


def _grad_stats_group(leaves, config: OptimizerConfig):
    """The dense leaves' grad-stats group, or, with every non-target frozen
    (``--freeze-non-targets``: no dense leaf), the group Megatron would give them: DP × model
    parallel under the distributed optimizer, else model parallel."""
    if leaves:
        return leaves[0].get_grad_stats_parallel_group()
    if config.use_distributed_optimizer:
        return parallel_state.get_intra_distributed_optimizer_instance_group()
    return parallel_state.get_model_parallel_group()


def get_loggra_optimizer(
    config: OptimizerConfig,
    model_chunks: list,
    loggra: LoGRAConfig | None = None,
    sites: list | None = None,
    **kwargs,
):
    """A Megatron-Core optimizer for DDP-wrapped ``model_chunks`` with LoGRA inside.

    ``config`` is Megatron's own (``optimizer="adam"``: lr, betas, eps, weight decay,
    clipping, precision, sharding), ``loggra`` LoGRA's settings (default ``LoGRAConfig()``:
    the backward sketch, rank hidden size / 8). The backward sketch
    (``loggra_sketch="backward"``) takes ``sites``, per chunk what
    ``backward_sites.prepare_model`` returned for it before DDP wrapped it, and returns the
    chain of ``build_backward_sketch``. The gradient sketch returns what
    ``megatron.core.optimizer.get_megatron_optimizer`` returns (``kwargs`` go to it: a leaf
    optimizer or a ``ChainedOptimizer``), with each leaf's inner optimizer replaced by
    ``ShardedLoGRAAdamW`` over Megatron's own param groups.
    """
    loggra = loggra or LoGRAConfig()
    build = resolve(SKETCH_MODES[loggra.loggra_sketch].builder)
    return build(config, loggra, model_chunks, sites, **kwargs)


def build_gradient_sketch(
    config: OptimizerConfig, loggra: LoGRAConfig, model_chunks, sites=None, **kwargs
):
    """``--loggra-sketch gradient``'s optimizer: Megatron's (``kwargs`` go to
    ``get_megatron_optimizer``) with ``ShardedLoGRAAdamW`` inside each leaf."""
    return _megatron_optimizer_with_loggra(config, model_chunks, loggra, **kwargs)


def _megatron_optimizer_with_loggra(config: OptimizerConfig, model_chunks, loggra, **kwargs):
    """Megatron's optimizer with ``ShardedLoGRAAdamW`` inside each leaf (nothing sketched
    with the backward sketch: its targets are in no leaf)."""
    check_loggra_settings(config, loggra)
    optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    info = _ParamInfo(model_chunks, loggra)
    clamped: list[tuple[int, int]] = []
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(leaf, "optimizer", None) is None:
            continue  # a stub optimizer (no trainable params on this rank)
        remainders = None
        if isinstance(leaf, DistributedOptimizer):
            if loggra.loggra_param_remainders:
                remainders = keep_masters_as_remainders(leaf)
            weights = _distributed_layouts(leaf, loggra, info, clamped)
        else:
            weights = _replicated_layouts(leaf, loggra, info, clamped)
        layouts, dp_group = weights.layouts, weights.dp_group
        held = {w: main for w, (_, main) in enumerate(weights.pairs) if w in layouts}
        all_layouts = [layouts[w] for w in sorted(layouts)]
        index = {w: i for i, w in enumerate(sorted(layouts))}
        leaf.optimizer = ShardedLoGRAAdamW(
            leaf.optimizer.param_groups,  # Megatron's: lr, betas, eps, weight decay, wd_mult
            all_layouts=all_layouts,
            held={index[w]: p for w, p in held.items() if p is not None},
            dp_rank=dp_group.rank() if dp_group is not None else 0,
            dp_group=dp_group,
            tp_dp_group=_tp_dp_group(dp_group),
            consensus_group=leaf.get_grad_stats_parallel_group(),
            param_remainders=remainders,
            energy_slots=info.energy_slots,
            rank=info.rank,
            update_interval=loggra.loggra_update_interval,
            projection=loggra.loggra_projection,
            oversample=loggra.loggra_oversample,
            power_iters=loggra.loggra_power_iters,
            scale=loggra.loggra_scale,
            min_dim=loggra.loggra_min_dim,
        )
        leaf.loggra = loggra  # LoGRA's settings, beside Megatron's leaf.config
        leaf.loggra_params = [
            (info.key(mp), mp, main, weights.own_ranges[w])
            for w, (mp, main) in enumerate(weights.pairs)
            if main is not None
        ]
        leaf.__class__ = loggra_class_for(type(leaf))
    if type(optimizer) is ChainedOptimizer:
        optimizer.__class__ = loggra_class_for(ChainedOptimizer)
    if clamped:
        warnings.warn(
            f"loggra_rank={info.rank} exceeds min(m, n) of {len(clamped)} weights "
            f"(e.g. {clamped[0]}); their rank is clamped to min(m, n).",
            stacklevel=2,
        )
    return optimizer


@dataclass
class _LeafWeights:
    """A leaf optimizer's weights in Megatron's grad-buffer order, as LoGRA lays them out."""

    pairs: list[tuple[torch.Tensor, torch.Tensor | None]]
    """``(model param, this rank's main shard or None)`` of each weight."""
    own_ranges: list[tuple[int, int]]
    """This rank's ``[start, end)`` of each weight (flat; ``(0, 0)``: none of it)."""
    layouts: dict[int, WeightLayout]
    """The sketched weights' layouts, by index into ``pairs``."""
    dp_group: torch.distributed.ProcessGroup | None
    """The group the weights are sharded over (None: replicated)."""


class _ParamInfo:
    """Names and seeds of model params, independent of TP/DP (same on every rank)."""

    def __init__(self, model_chunks, loggra: LoGRAConfig):
        self.gated = getattr(model_chunks[0].config, "gated_linear_unit", False)
        self.rank = loggra.rank_for(model_chunks[0].config.hidden_size)
        """The requested sketch rank (each weight's is clamped by its projection)."""
        self.names, self.seeds = {}, {}
        for c, chunk in enumerate(model_chunks):
            for name, p in chunk.named_parameters():
                self.names[p] = f"chunk{c}.{name.removeprefix('module.')}"
                self.seeds[p] = len(self.seeds)
        self.slots, self.energy_slots = energy_slots_of(model_chunks)

    def key(self, p) -> str:
        return self.names[p]

    def is_glu_fc1(self, p) -> bool:
        return self.gated and self.names.get(p, "").endswith("linear_fc1.weight")

    def sketched(self, p, loggra: LoGRAConfig) -> bool:
        if SKETCH_MODES[loggra.loggra_sketch].in_backward:
            return False  # the targets are frozen (backward_sites); what is left is dense
        name = self.names.get(p, "")
        projection = PROJECTIONS[loggra.loggra_projection]
        return not any(part in name for part in DENSE_NAME_PARTS) and projection.sketches(
            tuple(p.shape), loggra.loggra_min_dim
        )


def _layout(p, dp_ranges, loggra: LoGRAConfig, info, clamped) -> WeightLayout:
    """The layout of sketched model param ``p`` (TP-local ``[m, n]``)."""
    m, n = p.shape
    projection, requested = PROJECTIONS[loggra.loggra_projection], info.rank
    rank = projection.rank((m, n), requested)
    if projection.clamps((m, n), requested):
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
        seed=basis_seed(loggra.loggra_seed or 0, info.seeds[p]),
        dp_ranges=tuple(dp_ranges),
        row_offset=tp_rank * m if column_parallel else 0,
        global_rows=tp * m if column_parallel else m,
        reduce_over_tp=column_parallel,
        glu_halves=column_parallel and info.is_glu_fc1(p),
        energy_slot=info.slots.get(p, -1),
    )


def _distributed_layouts(leaf, loggra: LoGRAConfig, info, clamped) -> _LeafWeights:
    """A distributed optimizer leaf's weights: slices over DP as Megatron's buffers cut them."""
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
            if info.sketched(p, loggra):
                layouts[len(pairs)] = _layout(p, ranges, loggra, info, clamped)
            pairs.append((p, main))
            own_ranges.append(ranges[dp_rank])
    return _LeafWeights(pairs, own_ranges, layouts, leaf.data_parallel_group)


def _replicated_layouts(leaf, loggra: LoGRAConfig, info, clamped) -> _LeafWeights:
    """A replicated leaf's weights: every rank holds each whole."""
    pairs = [(model, main) for main, model, _, _ in main_params_of(leaf)]
    layouts = {
        w: _layout(p, [(0, p.numel())], loggra, info, clamped)
        for w, (p, _) in enumerate(pairs)
        if info.sketched(p, loggra)
    }
    return _LeafWeights(pairs, [(0, p.numel()) for p, _ in pairs], layouts, None)


def _tp_dp_group(dp_group):
    """The group spanning TP × (this optimizer's) DP, for column-parallel bases. Megatron's
    distributed optimizer shards over DP × CP, hence ``with_context_parallel=True``."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return dp_group
    if dp_group is None:
        return parallel_state.get_tensor_model_parallel_group()
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
