"""The model's state while it generates, set for the block and restored exactly after.

* **Eval mode** (no dropout).
* **Sequence parallelism off.** Decode steps have one token per row, which no sequence
  split can share; like Megatron's ``set_model_to_sequence_parallel`` (which its static
  controller uses), but each module's own previous flag is restored instead of setting them
  all back to True.
* **No FP8 amax all-reduce.** Transformer Engine configures its current-scaling quantizers
  (``--fp8-recipe tensorwise``) once, at the first FP8 forward: with sequence parallelism a
  column-parallel linear's input quantizer reduces its amax over the TP group
  (``with_amax_reduction``, ``Linear._customize_quantizers_float8_current_scaling`` in TE
  2.9-2.12), since each rank holds a slice of the sequence. Turning the modules'
  ``sequence_parallel`` off does not undo that, so every decode step would still run a
  blocking TP all-reduce per column-parallel linear (QKV and FC1: two per layer per token)
  on inputs that every TP rank now holds whole. Those flags are off for the block, and set by
  TE's rule after it, also on quantizers made inside the block: a first FP8 forward under
  generation (a run with no warm-up) would otherwise leave training without the reduction.
* **Fresh FP8 weights.** The first forward recasts TE's cached FP8 weights
  (``MegatronModule.set_is_first_microbatch``, as Megatron's schedule does for the first
  micro-batch): without it the rollout would sample from the weights of before the last
  optimizer step.
* **Or no FP8 at all** (``fp8=False``: ``--rollout-fp8`` not given): the model's config reads
  ``fp8=None`` for the block, so Megatron enters no FP8 autocast and TE's linears compute
  with the bf16 weights, which CUDA graphs capture like any bf16 step (an FP8 forward updates
  TE's scaling state on the host, which a plain capture would freeze). Megatron's TE
  wrappers clear ``is_first_microbatch`` after any forward, FP8 or not, so the first FP8
  forward after the block is asked to recast again: the cache it would otherwise use was
  cast before the last optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["generation_mode"]

SP_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
"""The module attributes that carry sequence parallelism in Megatron-Core and TE."""


def _amax_reducing_quantizers(modules) -> list[tuple[object, object]]:
    """``(quantizer, TP group)`` for each quantizer TE's rule gives an amax reduction: the
    forward input quantizer (``scaling_fwd[0]``) of a column-parallel TE linear with
    sequence parallelism on, under current scaling (the quantizers that have
    ``with_amax_reduction``). Before the first FP8 forward a module has none."""
    found = []
    for m in modules:
        quantizers = getattr(m, "quantizers", None)
        forward = quantizers.get("scaling_fwd") if isinstance(quantizers, dict) else None
        column = getattr(m, "parallel_mode", None) == "column"
        if not (isinstance(forward, list) and column and getattr(m, "sequence_parallel", False)):
            continue
        if forward and hasattr(forward[0], "with_amax_reduction"):
            found.append((forward[0], m.tp_group))
    return found


@contextlib.contextmanager
def generation_mode(model, fp8: bool = True) -> Iterator[None]:
    """Eval mode, sequence parallelism and TE's amax reductions off, and fresh FP8 weights
    or (``fp8=False``) no FP8, for the block (module docstring); restores every flag
    exactly."""
    from megatron.core.utils import get_attr_wrapped_model, get_model_config, unwrap_model

    config = get_model_config(model)
    sequence_parallel = config.sequence_parallel
    modules = list(unwrap_model(model).modules()) if sequence_parallel else []
    saved = [(m, a, getattr(m, a)) for m in modules for a in SP_ATTRS if hasattr(m, a)]
    if sequence_parallel:
        saved.append((config, "sequence_parallel", True))
    bf16_of_fp8 = bool(config.fp8) and not fp8
    if bf16_of_fp8:
        saved.append((config, "fp8", config.fp8))
    training = model.training
    model.eval()
    inner = unwrap_model(model)
    if hasattr(inner, "set_is_first_microbatch"):
        inner.set_is_first_microbatch()
    reducing = _amax_reducing_quantizers(modules)
    try:
        for owner, attr, _ in saved:
            setattr(owner, attr, None if attr == "fp8" else False)
        for quantizer, _ in reducing:
            quantizer.with_amax_reduction = False
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
        for quantizer, group in _amax_reducing_quantizers(modules):  # TE's rule, with SP on
            quantizer.with_amax_reduction, quantizer.amax_reduction_group = True, group
        model.train(training)
        get_attr_wrapped_model(model, "set_input_tensor")(None)  # drop the last recv buffer
        if bf16_of_fp8 and hasattr(inner, "set_is_first_microbatch"):
            inner.set_is_first_microbatch()  # the bf16 forwards cleared the recast request
