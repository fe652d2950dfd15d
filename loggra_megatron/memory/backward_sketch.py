# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The terms of ``--optimizer loggra --loggra-sketch backward`` (LoGRA as published) in
``memory.model`` (pure arithmetic, no torch).

The targets (``--loggra-targets``: ``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2`` of every layer, TP-local ``[m, n]``) are frozen for autograd before DDP wraps
the model (``optim/megatron/backward_sites.py``): they have no grad-buffer bytes and no fp32
grad copy. What they hold instead (``D`` the DP size under the distributed optimizer, else
1; ``k = ⌈m/D⌉`` the rows a DP rank owns; ``r`` the sketch rank):

* masters of the owned rows only, ``k·n`` elements at ``bytes_per_master``;
* RowAdam's ``exp_avg_sq``, 4 bytes per owned row (0 with ``--loggra-row-optimizer sgd``);
* the flat fp32 sketch buffer ``[D, Σ k, r]`` on every rank (not sharded: every rank sums all
  rows in its backward, one reduce-scatter gives it its own), or only this rank's ``[Σ k, r]``
  with ``--loggra-sketch-reduce microbatch`` (each layer's rows are reduce-scattered in its
  backward hook: the hook's transient is the ``[m, r]`` product, its padded copy and the
  ``[k, r]`` received);
* the update's Rademacher projections, one bit per entry of each target's ``B``
  (``[r, ⌈n/8⌉]`` uint8, ``signs_cache_bytes``), held from the first training forward of an
  update to the end of its step: counted in the training phase and the optimizer step (the
  KL-control phase, between them, has no sketch term: neither these bytes nor a trial's
  write, which is the step's update transient, are counted there);
* in the backward, ``P = X·Bᵀ`` (``[tokens, r]``, activation dtype) per target of every layer
  whose activations are held, and no saved input of the frozen ``linear_fc2``
  (``frozen_input_bytes_per_layer``);
* in the optimizer step, the largest of the reduce-scatter's receive buffer, one weight's
  update and one bucket of the weight sync's all-gather, two with ``--overlap-param-gather``
  (``step_bytes``, ``gather_buckets``).

Everything else is dense: LoGRA's AdamW with nothing sketched, as the gradient mode treats
its dense parameters. Formulas and what they assume: ``docs/memory.md`` ("The backward
sketch").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loggra_megatron.memory.shape import (
    TransformerShape,
    ceil_div,
    param_dtype_bytes,
)
from loggra_megatron.memory.transient import layers_held
from loggra_megatron.optim.backward_sketch.row_updates import ROW_UPDATES
from loggra_megatron.optim.backward_sketch.sketch import ROW_GATHER_BUCKET_NUMEL
from loggra_megatron.optim.registry import backward_sketch
from loggra_megatron.train.step_plan import StepPlan

__all__ = [
    "ROW_PARALLEL",
    "SketchTerms",
    "applies",
    "buffer_bytes",
    "frozen_input_bytes_per_layer",
    "gather_buckets",
    "hook_bytes",
    "master_bytes",
    "projection_bytes_per_layer",
    "row_state_bytes",
    "signs_cache_bytes",
    "sketch_rank",
    "sketch_terms",
    "step_bytes",
    "target_of",
]

ROW_PARALLEL = ("linear_proj", "linear_fc2")
"""Row-parallel targets (``W_local [m, n/t]``); the others are column-parallel."""


def applies(plan: StepPlan) -> bool:
    """Whether ``plan`` runs the backward sketch (a sketching optimizer with
    ``loggra_sketch="backward"``; dense Adam's column of the same step does not)."""
    return backward_sketch(plan.optimizer, plan.loggra_sketch)


def sketched_params(params: list, plan: StepPlan) -> list:
    """The parameters of ``params`` that ``plan``'s backward sketch targets
    (``--loggra-targets``)."""
    names = set(plan.loggra_targets)
    return [s for s in params if s.kind == "linear" and target_of(s) in names]


def target_of(spec: Any) -> str:
    """The layer name of a parameter (``…linear_qkv.weight`` → ``linear_qkv``)."""
    return spec.name.split(".")[-2]


def _full_cols(model: TransformerShape, target: str) -> int:
    """Columns of the whole weight (the width ``B`` is drawn for)."""
    return {
        "linear_qkv": model.hidden_size,
        "linear_proj": model.num_attention_heads * model.kv_channels,
        "linear_fc1": model.hidden_size,
        "linear_fc2": model.ffn_hidden_size,
    }[target]


def sketch_rank(model: TransformerShape, plan: StepPlan) -> int:
    """``r``: ``--loggra-rank`` clamped to the narrowest target's full input width, as
    ``SketchSites`` clamps it."""
    return min(plan.loggra_rank, *(_full_cols(model, t) for t in plan.loggra_targets))


def master_bytes(targets, dp: int, bytes_per_master: int) -> int:
    """Masters of this DP rank's rows: ``bytes_per_master · ⌈m/D⌉ · n`` per target."""
    return bytes_per_master * sum(ceil_div(s.shape[0], dp) * s.shape[1] for s in targets)


def row_state_bytes(targets, dp: int, row_optimizer: str) -> int:
    """RowAdam's fp32 second moment per owned row (``⌈m/D⌉`` per target), or nothing."""
    per_row = ROW_UPDATES[row_optimizer].state_bytes_per_row
    return per_row * sum(ceil_div(s.shape[0], dp) for s in targets)


def buffer_bytes(targets, segments: int, rank: int, reduced_in_backward: bool = False) -> int:
    """The fp32 sketch buffer ``[segments, Σ ⌈m/segments⌉, r]`` on every rank (≈
    ``4·Σm·r``), or, ``reduced_in_backward``, this rank's one segment."""
    held = 1 if reduced_in_backward else segments
    return 4 * held * sum(ceil_div(s.shape[0], segments) for s in targets) * rank


def signs_cache_bytes(targets, rank: int) -> int:
    """The update's packed Rademacher projections: ``r·⌈n/8⌉`` bytes per target (``n`` the
    TP-local width: a row-parallel target keeps its column block only). The plan does not
    say ``--loggra-sketch-matrix``; a Gaussian ``B`` is not kept (``step_bytes`` counts its
    draw, the larger transient of the two)."""
    return rank * sum(ceil_div(s.shape[1], 8) for s in targets)


def hook_bytes(targets, segments: int, rank: int, reduced_in_backward: bool) -> int:
    """One backward hook's fp32 transient at its largest: the ``[m, r]`` product, and when it
    is reduce-scattered there its zero-padded ``[segments·k, r]`` copy (odd splits) and the
    ``[k, r]`` received."""
    most = 0
    for s in targets:
        m, k = s.shape[0], ceil_div(s.shape[0], segments)
        rows = m
        if reduced_in_backward:
            rows += k + (k * segments if k * segments != m else 0)
        most = max(most, 4 * rows * rank)
    return most


def step_bytes(
    targets,
    segments: int,
    rank: int,
    weight_bytes: int,
    tp: int,
    reduced_in_backward=False,
    pipelined: bool = False,
) -> int:
    """The backward sketch's optimizer step, one phase after the other, at its largest:

    * the reduce-scatter's receive buffer, one fp32 segment ``[Σ k, r]`` (``segments > 1``
      and not ``reduced_in_backward``);
    * RowAdam's update of one weight: the fp32 target and reconstruction ``D·A`` (``[k, n]``
      each), the signs ``B`` drawn for the full width ``[r, n_full]`` in the weight dtype and
      their fp32 copy ``[r, n]`` (16-bit weights), the fp32 direction and clipped sketch
      (``[k, r]`` each) and the new second moments (``[k]``). That is a Gaussian ``B``'s
      draw; a Rademacher ``B`` is unpacked from its bits instead, ``[r, n]`` in the weight
      dtype, less: the plan does not say which, so the larger is counted;
    * the all-gather of the rows over DP (``segments > 1``): one bucket's ``[segments, E]``
      buffer in the weight dtype (``gather_buckets``), two with ``--overlap-param-gather``
      (the next bucket's gather runs while one is copied back).

    ``k = ⌈m/segments⌉``."""
    if not targets:
        return 0
    chunks = [(ceil_div(s.shape[0], segments), s.shape[1], s) for s in targets]
    reduce_at_step = segments > 1 and not reduced_in_backward
    receive = 4 * sum(k for k, _, _ in chunks) * rank if reduce_at_step else 0
    update = 0
    for k, n, spec in chunks:
        full = n * tp if target_of(spec) in ROW_PARALLEL else n
        signs = weight_bytes * rank * full + (4 * rank * n if weight_bytes != 4 else 0)
        update = max(update, 8 * k * n + signs + 8 * k * rank + 4 * k)
    buckets = sorted(gather_buckets(targets, segments), reverse=True)
    gather = weight_bytes * sum(buckets[: 2 if pipelined else 1])
    return max(receive, update, gather)


def gather_buckets(targets, segments: int) -> list[int]:
    """Elements of each bucket of the weight sync over DP (``optim/megatron/backward_row_gather.py``):
    consecutive targets, ``segments · ⌈m/segments⌉ · n`` each, up to
    ``ROW_GATHER_BUCKET_NUMEL`` per bucket (a larger target alone); none at one segment."""
    if segments < 2:
        return []
    buckets = [0]
    for spec in targets:
        size = segments * ceil_div(spec.shape[0], segments) * spec.shape[1]
        if buckets[-1] and buckets[-1] + size > ROW_GATHER_BUCKET_NUMEL:
            buckets.append(0)
        buckets[-1] += size
    return buckets


def _tokens(plan: StepPlan, target: str) -> int:
    """Tokens of one micro-batch whose ``P`` a target keeps: all of them (column-parallel;
    row-parallel without sequence parallelism), this TP rank's under sequence parallelism
    for the row-parallel ones."""
    sb, t = plan.micro_batch_size * plan.seq_length, plan.tensor_model_parallel_size
    if target in ROW_PARALLEL and plan.sequence_parallel and t > 1:
        return ceil_div(sb, t)
    return sb


def projection_bytes_per_layer(plan: StepPlan, rank: int, activation_bytes: int = 2) -> int:
    """``P = X·Bᵀ`` of one layer's targets for one micro-batch: ``tokens · r`` elements each,
    kept from the forward hook to the target's backward."""
    return sum(_tokens(plan, t) * rank * activation_bytes for t in plan.loggra_targets)


def frozen_input_bytes_per_layer(model: TransformerShape, plan: StepPlan) -> int:
    """Bytes of one layer's saved activations (``transient.activation_bytes_per_layer``) that
    were saved only for a target's weight gradient, which a frozen weight does not compute
    (Megatron's ``linear_with_frozen_weight`` saves the weight only; Transformer Engine's
    ``Linear`` saves its input only when the weight needs a gradient):

    * ``linear_fc2``: its input, the MLP activation's output ``2sb·f/t`` (the fused
      bias-SwiGLU/GeLU saves its own input, fc1's output, counted apart): removed;
    * ``linear_proj``: its input is the attention output, which flash attention saves for
      its own backward: kept;
    * ``linear_qkv``, ``linear_fc1``: their input is a norm's output, which Transformer
      Engine's fused ``LayerNormLinear`` saves whether or not the weight is frozen (and an
      unfused norm saves its normalised input for its own weight): kept."""
    if "linear_fc2" not in plan.loggra_targets:
        return 0
    sb = plan.micro_batch_size * plan.seq_length
    return ceil_div(2 * sb * model.ffn_hidden_size, plan.tensor_model_parallel_size)


@dataclass(frozen=True)
class SketchTerms:
    """The backward sketch on one GPU (all zero, no targets, without it)."""

    targets: tuple = ()
    """This stage's target weights (``ParamSpec`` of ``memory.model``)."""
    dp: int = 1
    """Rows are split over this many ranks (the buffer's segments)."""
    rank: int = 0
    row_state: int = 0
    buffer: int = 0
    step: int = 0
    """The optimizer step's transient (``step_bytes``) and the update's packed projections."""
    projections: int = 0
    """``P`` of every layer held in the backward, one ``[m, r]`` fp32 product of a backward
    hook at a time, and the update's packed projections."""
    activation_saving: int = 0
    """Saved activations of the held layers that the frozen targets no longer need."""
    frozen_rest: bool = False
    """Every parameter but the targets is frozen too (``--freeze-non-targets``)."""

    def masters(self, bytes_per_master: int) -> int:
        return master_bytes(self.targets, self.dp, bytes_per_master)

    def dense_of(self, params: list) -> list:
        """``params`` less the targets: what the dense leaves update (nothing with
        ``frozen_rest``)."""
        if self.frozen_rest:
            return []
        frozen = {id(s) for s in self.targets}
        return [s for s in params if id(s) not in frozen] if frozen else params


def sketch_terms(
    model: TransformerShape, plan: StepPlan, stage: int, params: list, dp: int
) -> SketchTerms:
    """The backward sketch's terms on PP stage ``stage`` (``params``: its parameters; ``dp``:
    the DP size under the distributed optimizer, else 1): its ``SKETCH_MODES`` entry's
    ``memory_terms``, which ``memory.model.sketch_mode_terms`` calls for a sketching
    optimizer only."""
    targets = tuple(sketched_params(params, plan))
    r, w = sketch_rank(model, plan), param_dtype_bytes(plan)
    layers, _ = layers_held(model, plan, stage)
    in_backward = dp > 1 and plan.loggra_sketch_reduce == "microbatch"
    per_layer = projection_bytes_per_layer(plan, r, w)
    signs = signs_cache_bytes(targets, r)  # held in the training phase and the step
    return SketchTerms(
        targets=targets,
        dp=dp,
        rank=r,
        row_state=row_state_bytes(targets, dp, plan.loggra_row_optimizer),
        buffer=buffer_bytes(targets, dp, r, in_backward),
        step=step_bytes(
            targets,
            dp,
            r,
            w,
            plan.tensor_model_parallel_size,
            in_backward,
            plan.overlap_param_gather,
        )
        + signs,
        projections=layers * per_layer + hook_bytes(targets, dp, r, in_backward) + signs,
        activation_saving=layers * frozen_input_bytes_per_layer(model, plan),
        frozen_rest=plan.freeze_non_targets,
    )
