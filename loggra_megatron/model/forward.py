"""The GPT forward passes every component shares: Megatron's schedule over micro-batches,
and token log-probs from vocab-parallel logits.

A micro-batch is a dict with ``tokens [b, s + 1]``: positions ``0 .. s - 1`` are fed and the
logits at position ``t`` score ``tokens[:, t + 1]`` (the causal-LM shift). Every pass runs
through ``megatron.core.pipeline_parallel.get_forward_backward_func``, so it is pipelined
(1F1B under PP) the way Megatron-LM's training loop runs it:

* ``run_schedule`` — forward + backward with a loss (the actor), or forward-only; every
  micro-batch right-padded to the ``sequence_multiple`` that sequence parallelism and
  Transformer Engine's FP8 GEMMs need, or packed (THD, ``model.packing``)
  for a model built with ``sequence_packing``;
* ``forward_map`` — forward-only, ``fn(micro_batch, last_hidden)`` applied on the last
  pipeline stage and collected (the KL probe, log-prob recompute); ``None`` on other stages;
* ``gpt_forward`` and ``last_hidden`` — every log-prob forward returns the last
  hidden states, and ``LastHidden`` scores them in
  token chunks: no full-vocabulary logits of a batch exist
  (``model.output_head``).

``initialize_fp8_state`` runs the one forward that makes TE's lazily created FP8 state
before any inference-mode forward.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from loggra_megatron.model.batching import PaddingStats, fed_lengths
from loggra_megatron.model.output_head import (
    DEFAULT_CHUNK,
    LOG_PROB_CHUNK,
    LastHidden,
    emit_hidden,
    output_weight,
)
from loggra_megatron.model.packing import PACKED, pack_micro_batch

PACKS_SEQUENCES = "packs_sequences"
"""Attribute of a ``GPTModel`` built with ``sequence_packing``
(``build_gpt_model``): its forwards take packed rows."""


def positions_like(x: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions ``0 .. s - 1`` for inputs ``x [b, s]``."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand_as(x)


def packs_sequences(model) -> bool:
    """Whether the (wrapped) model's forwards take the micro-batches packed (THD)."""
    from megatron.core.utils import unwrap_model

    return bool(getattr(unwrap_model(model), PACKS_SEQUENCES, False))


def gpt_forward(model, batch: dict) -> torch.Tensor:
    """The (DDP-/Float16-wrapped) GPT model on ``batch["tokens"][:, :-1]`` with its output
    layer passing the hidden states through (``emit_hidden``): the
    final-norm hidden states ``[b, s, h]`` on the last pipeline stage (``[1, T, h]`` for a
    packed micro-batch, ``PACKED``), the activations
    handed to the next stage elsewhere. ``last_hidden`` scores them."""
    packed = batch.get(PACKED)
    with emit_hidden(model):
        if packed is None:
            x = batch["tokens"][:, :-1]
            return model(x, positions_like(x), None)
        return model(
            packed.input_ids,
            packed.position_ids,
            None,
            packed_seq_params=packed.packed_seq_params(),
        )


def last_hidden(model, batch: dict, hidden: torch.Tensor) -> LastHidden:
    """The last stage's ``gpt_forward`` output of ``batch`` with this TP rank's output
    weight shard, Megatron's TP group and the model's ``--log-prob-chunk-size``."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    return LastHidden(
        hidden,
        output_weight(gpt),
        batch,
        tp_group=ps.get_tensor_model_parallel_group(),
        chunk=getattr(gpt, LOG_PROB_CHUNK, DEFAULT_CHUNK),
        # tied to the word embeddings of this stage: both gradients must reach .grad
        into_main_grad=not (gpt.share_embeddings_and_output_weights and gpt.pre_process),
    )


def fp8_alignment(config) -> int:
    """The token count Transformer Engine's FP8 GEMMs need a multiple of, for every operand a
    module sees, the local sequence shard included: 16, 32 for MXFP8
    (``megatron.core.fp8_utils.get_fp8_align_size``); 1 without FP8."""
    if not config.fp8:
        return 1
    return 32 if str(config.fp8_recipe).endswith("mxfp8") else 16


def sequence_multiple(config) -> int:
    """What the fed length ``s`` of a micro-batch must be a multiple of, for a model with
    Megatron ``TransformerConfig`` ``config``: TP under sequence parallelism, the FP8
    alignment under FP8, and both at once TP × the alignment: under sequence parallelism TE
    checks the *local* ``[s/TP, b, h]`` shard a column-parallel linear receives (before its
    all-gather), so ``s/TP`` itself must be aligned whatever the micro-batch size."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return tp * fp8_alignment(config)


UNPADDED_LENGTH = "unpadded_length"
"""Key of a padded micro-batch that holds its length ``s`` before padding."""


def unpadded_length(batch: dict) -> int:
    """The fed length ``s`` of a micro-batch before ``pad_micro_batch`` padded it."""
    return batch.get(UNPADDED_LENGTH, batch["tokens"].shape[1] - 1)


def pad_micro_batch(batch: dict, multiple: int, width: int = 0) -> dict:
    """``batch`` with ``tokens [b, s + 1]`` and its ``[b, s, ...]`` tensors right-padded to
    at least ``width`` positions, and so that ``s`` is a multiple of ``multiple`` (zeros: no
    token, no mask, no loss); the length before padding is kept under
    ``UNPADDED_LENGTH``."""
    tokens = batch["tokens"]
    seq = tokens.shape[1] - 1
    extra = max(seq, width) - seq
    extra += -(seq + extra) % multiple
    if extra == 0:
        return batch
    out = {UNPADDED_LENGTH: unpadded_length(batch)}
    for key, value in batch.items():
        if (
            isinstance(value, torch.Tensor)
            and value.ndim >= 2
            and (key == "tokens" or value.shape[1] == seq)
        ):
            pad = value.new_zeros((value.shape[0], extra, *value.shape[2:]))
            value = torch.cat([value, pad], dim=1)
        out[key] = value
    return out


def run_schedule(
    model,
    forward_step: Callable,
    micro: list[dict],
    *,
    forward_only: bool,
    collect_non_loss_data: bool = False,
    padding: PaddingStats | None = None,
) -> list:
    """Megatron's ``forward_backward_func`` over ``micro`` (one model chunk), each
    micro-batch padded on the right to the model's ``sequence_multiple``: the extra
    positions are ``tokens`` 0 and zeros in every ``[b, s]`` tensor (masks, old/reference
    log-probs), so they carry no loss; causal attention keeps them out of the real positions'
    logits. A model that ``packs_sequences`` is fed each micro-batch as one packed row
    of its rows' ``LENGTHS`` instead. Under PP every
    micro-batch is padded to the longest (the stages exchange activations of one shape).
    ``padding``: counts the slots fed."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    multiple = sequence_multiple(get_model_config(model))
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    if packs_sequences(model):
        lengths = [fed_lengths(b) for b in micro]
        width = max(int(n.sum()) for n in lengths) if pipelined else 0
        micro = [
            pack_micro_batch(b, n, multiple, width) for b, n in zip(micro, lengths, strict=True)
        ]
        seq_length, rows = micro[0][PACKED].num_slots, 1
    else:
        width = max(b["tokens"].shape[1] - 1 for b in micro) if pipelined else 0
        micro = [pad_micro_batch(b, multiple, width) for b in micro]
        seq_length, rows = micro[0]["tokens"].shape[1] - 1, micro[0]["tokens"].shape[0]
    if padding is not None:
        for b in micro:
            padding.count(b)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=seq_length,
        micro_batch_size=rows,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


def _map_step(fn, data_iterator, model):
    batch = next(data_iterator)
    hidden = gpt_forward(model, batch)
    return hidden, lambda out, non_loss_data=True: fn(batch, last_hidden(model, batch, out))


@torch.no_grad()
def forward_map(
    model,
    micro: list[dict],
    fn: Callable[[dict, LastHidden], object],
    padding: PaddingStats | None = None,
):
    """``[fn(micro_batch, its LastHidden) for each micro-batch]`` on the last pipeline stage (None on
    the others): a forward-only, no-grad pass, the model in eval mode for its duration
    (``padding``: counts the slots fed)."""
    from megatron.core import parallel_state as ps

    was_training = model.training
    model.eval()
    try:
        out = run_schedule(
            model,
            partial(_map_step, fn),
            micro,
            forward_only=True,
            collect_non_loss_data=True,
            padding=padding,
        )
    finally:
        model.train(was_training)
    return out if ps.is_pipeline_last_stage() else None


def initialize_fp8_state(model) -> None:
    """One forward-only pass of a one-row batch under ``no_grad`` (*not* inference mode), so
    that Transformer Engine's FP8 state, which TE creates lazily at a module's first FP8
    forward and never recreates (delayed-scaling scale and amax history, quantizers), is made
    of normal tensors. Otherwise the first FP8 forward of a run can be the dynamic engine's,
    under ``torch.inference_mode``, and the first recompute backward of the training step
    fails writing into that state ("Inplace update to inference tensor outside
    InferenceMode"). No-op without FP8; every rank of the model replica calls it."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    if not config.fp8:
        return
    device = next(model.parameters()).device
    tokens = torch.zeros(1, sequence_multiple(config) + 1, dtype=torch.long, device=device)
    forward_map(model, [{"tokens": tokens}], lambda batch, logits: None)
