"""Token log-probs from the last hidden states, chunked over tokens: the full-vocabulary logits
of a batch never exist.

A log-prob forward (training loss, old/reference log-probs, KL probe) runs the model with its
output layer switched to pass the final-norm hidden states through (``emit_hidden``), and
hands the consumer a ``LastHidden``. ``ChunkedTokenLogProbs`` then computes, for
``n`` tokens ``x [n, h]``, this TP rank's output weight shard ``W_t [V/TP, h]`` and targets
``a [n]``, in chunks of ``c`` tokens::

    z = x_c W_tᵀ                 [c, V/TP]   (the model's dtype, as Megatron's output layer)
    lse = vocab_parallel_logsumexp(z)        (fp32; a max and a sum all-reduced over TP)
    log π(a) = z_a − lse                     (z_a: summed over TP, zero off its shard)

and keeps only ``x``, ``lse [n]`` and the targets for the backward, which recomputes each
chunk's logits (one more output-layer GEMM per chunk, no second TP reduction)::

    ∂/∂z_v = g · (1[v = a] − softmax(z)_v)       g = ∂L/∂log π(a)   [c]
    ∂x_c = ∂z W_t,   ∂W_t = Σ_c ∂zᵀ x_c          (∂W_t accumulated in fp32, cast once)

The softmax term is exact on each shard, so ``∂z`` is this rank's slice of the full gradient;
``∂x`` is a partial sum over the vocabulary shards, summed over TP by the region ``x`` came
through, as in Megatron's ``ColumnParallelLinear``: ``copy_to_tensor_model_parallel_region``
(all-reduce in the backward), or under sequence parallelism
``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter backward).

Memory, ``V_t = V/TP``: a forward-only chunk holds ``10·c·V_t`` bytes (bf16 logits, fp32
copy, fp32 exponentials), a backward chunk ``12·c·V_t``, and the weight gradient ``6·V_t·h``
(fp32 accumulator + the cast), or, under Megatron's DDP, only ``2·V_t·h`` (each chunk's
gradient goes into ``main_grad``, plus the placeholder DDP's hook skips); in place of ``[b, s, V_t]`` logits in bf16 plus 3–4 fp32
copies. Values equal the unchunked log-softmax's to round-off (tests/integration/test_output_head.py).
Cf. Liger-Kernel's fused linear cross-entropy and NeMo-RL's chunked log-probs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from loggra_megatron.model.config import MAX_LOG_PROB_CHUNK
from loggra_megatron.model.packing import PACKED
from loggra_megatron.model.vocab_parallel import (
    shard_targets,
    vocab_parallel_max,
    vocab_parallel_sum,
)

LOG_PROB_CHUNK = "log_prob_chunk_size"
"""Attribute of a ``GPTModel`` built by ``build_gpt_model``:
the tokens per chunk of its log-prob forwards (``--log-prob-chunk-size``)."""
DEFAULT_CHUNK = MAX_LOG_PROB_CHUNK
"""Tokens per chunk of a model built elsewhere (no ``LOG_PROB_CHUNK`` attribute)."""


def _chunk_logsumexp(z: torch.Tensor, tp_group) -> torch.Tensor:
    """``lse [c]`` (fp32) of ``z [c, V/TP]`` over the whole vocabulary, with one fp32 copy and
    its in-place exponentials alive at once (``vocab_parallel_logsumexp`` without a graph)."""
    zf = z.float()
    m = vocab_parallel_max(zf, tp_group)
    total = zf.sub_(m.unsqueeze(-1)).exp_().sum(dim=-1)
    del zf
    return m + vocab_parallel_sum(total, tp_group).log()


class ChunkedTokenLogProbs(torch.autograd.Function):
    """``log π(a) [n]`` (fp32) of ``hidden [n, h]``, ``weight [V/TP, h]``, ``targets [n]``,
    in chunks of ``chunk`` tokens, recomputed in the backward (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, tp_group, into_main_grad: bool):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        picked = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            z = hidden[lo:hi] @ weight.t()  # [c, V/TP]
            local, mine = shard_targets(targets[lo:hi], z.shape[-1], tp_group)
            picked[lo:hi] = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() * mine
            lse[lo:hi] = _chunk_logsumexp(z, tp_group)
            del z
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.tp_group, ctx.into_main_grad = chunk, tp_group, into_main_grad
        return vocab_parallel_sum(picked, tp_group) - lse

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        n, chunk = hidden.shape[0], ctx.chunk
        grad = grad.float()
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        fused = ctx.needs_input_grad[1] and ctx.into_main_grad and hasattr(weight, "main_grad")
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            x = hidden[lo:hi]
            g = grad[lo:hi].unsqueeze(-1)
            # ∂z = g·(onehot − p), built in place on the fp32 probabilities
            dz = (x @ weight.t()).float().sub_(lse[lo:hi].unsqueeze(-1)).exp_().mul_(-g)
            local, mine = shard_targets(targets[lo:hi], dz.shape[-1], ctx.tp_group)
            dz.scatter_add_(-1, local.unsqueeze(-1), g * mine.unsqueeze(-1))
            dz = dz.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = dz @ weight
            if ctx.needs_input_grad[1]:
                part = dz.t() @ x  # [V/TP, h]
                if fused:  # as Megatron's gradient_accumulation_fusion: no accumulator
                    weight.main_grad.add_(part)
                elif hi - lo == n:  # one chunk: no accumulator
                    grad_weight = part
                elif grad_weight is None:
                    grad_weight = part.float()
                else:
                    grad_weight.add_(part)
            del dz
        if fused:  # Megatron's convention: DDP's hook skips this placeholder
            weight.grad_added_to_main_grad = True
            grad_weight = torch.empty_like(weight)
        elif grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    tp_group=None,
    into_main_grad: bool = False,
) -> torch.Tensor:
    """``log π(targets)`` ``[...]`` of ``hidden [..., h]`` through the output weight shard
    ``weight [V/TP, h]`` (``tp_group``: the group the vocabulary is split over; None: whole).
    ``into_main_grad``: a weight with Megatron DDP's ``main_grad`` gets each chunk's gradient
    added there (``grad_added_to_main_grad``, as Megatron's fused weight-gradient
    accumulation), with no fp32 accumulator; only for a weight no other op of the stage
    uses (not the word embeddings tied to it on the first stage: DDP's hook would then drop
    the embedding's gradient)."""
    shape = targets.shape
    flat = ChunkedTokenLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        chunk,
        tp_group,
        into_main_grad,
    )
    return flat.view(shape)


def output_weight(gpt) -> torch.Tensor:
    """The (unwrapped) ``GPTModel``'s output weight, as its ``_postprocess`` picks it: the
    shared word embeddings when tied, else the output layer's."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides on every dimension, size-1 ones included (``contiguous()``
    keeps a strided size-1 dimension)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    if t.stride() == tuple(reversed(strides)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class _RowMajorGrad(torch.autograd.Function):
    """Identity whose backward hands on a row-major gradient. The ``[s, b, h] → [b, s, h]``
    transpose after the output layer gives back a strided one, and downstream (1) Megatron's
    ``_reduce`` (the TP region's backward) all-reduces ``grad.contiguous()``, a copy that it
    then drops, and (2) with ``b = 1`` the frozen linear layers' ``grad.matmul(weight)``
    (``--loggra-sketch backward``) cannot fold ``[s, 1, m]`` into a matrix and expands the
    weight to ``[s, m, n]``: torch's ``should_fold`` checks the size-1 dimension's stride,
    which ``contiguous()`` leaves as it is."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _row_major(grad)


@contextlib.contextmanager
def emit_hidden(model):
    """Within the block, the (wrapped) model's output layer returns its input, summed over
    TP in the backward as the layer would (gathered along tokens under sequence parallelism),
    so the model returns the final-norm hidden states ``[b, s, h]`` in place of logits."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    layer = getattr(gpt, "output_layer", None) if gpt.post_process else None
    if layer is None:
        yield
        return
    group = getattr(layer, "tp_group", None)

    def hidden_through(x, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group=group)
        else:
            x = copy_to_tensor_model_parallel_region(x, group=group)
        return _RowMajorGrad.apply(x), None

    layer.forward = hidden_through
    try:
        yield
    finally:
        del layer.forward  # the class's forward again


@dataclass
class LastHidden:
    """What a log-prob forward hands its consumer on the last pipeline stage: the hidden
    states of a micro-batch and how to score them. Position ``t`` scores ``tokens[:, t + 1]``;
    a packed micro-batch is scored on its packed row and returned in the ``[b, s]`` layout."""

    hidden: torch.Tensor
    """``[b, s, h]``, or ``[1, T, h]`` for a packed micro-batch (Megatron's ``Float16Module``
    hands the last stage's output back in fp32: ``fed`` is it in the weight's dtype)."""
    weight: torch.Tensor
    """``[V/TP, h]`` this TP rank's output weight shard."""
    batch: dict
    """The micro-batch (``tokens [b, s + 1]``; ``packed``: its packed rows)."""
    tp_group: object = None
    chunk: int = DEFAULT_CHUNK
    into_main_grad: bool = False
    """Add the weight's gradient into its DDP ``main_grad`` chunk by chunk
    (``chunked_token_log_probs``)."""
    _log_probs: torch.Tensor | None = field(default=None, repr=False)

    @property
    def fed(self) -> torch.Tensor:
        """The hidden states in the output weight's dtype, as the output layer gets them."""
        return self.hidden.to(self.weight.dtype)

    def _in_batch_layout(self, values: torch.Tensor) -> torch.Tensor:
        """``values [1, T, ...]`` of a packed micro-batch in its ``[b, s, ...]`` layout;
        others as they are."""
        packed = self.batch.get(PACKED)
        return values if packed is None else packed.unpack(values)

    def targets(self) -> torch.Tensor:
        """The scored tokens in the hidden states' layout: ``[b, s]`` or ``[1, T]``."""
        packed = self.batch.get(PACKED)
        tokens = self.batch["tokens"]
        if packed is None:
            return tokens[:, 1:]
        out = tokens.new_zeros(1, packed.num_slots)
        out[0, : packed.num_real] = tokens[packed.rows, packed.positions + 1]
        return out

    def log_probs(self) -> torch.Tensor:
        """``[b, s]`` fp32 log-probs of the targets, differentiable when the hidden states
        are; computed once (chunked, ``ChunkedTokenLogProbs``)."""
        if self._log_probs is None:
            out = chunked_token_log_probs(
                self.fed,
                self.weight,
                self.targets(),
                self.chunk,
                self.tp_group,
                self.into_main_grad,
            )
            self._log_probs = self._in_batch_layout(out)
        return self._log_probs

    def per_token(self, fn) -> torch.Tensor:
        """``[b, s]``: ``fn(z [c, V/TP] fp32 logits, tp_group) -> [c]`` on each chunk of
        tokens, under activation checkpointing (each chunk's logits are recomputed in the
        backward), e.g. an entropy bonus's ``lse(z) − Σ_v p_v z_v``."""
        from torch.utils.checkpoint import checkpoint

        def chunk_values(x):
            return fn((x @ self.weight.t()).float(), self.tp_group)

        flat = self.fed.reshape(-1, self.hidden.shape[-1])
        parts = [
            checkpoint(chunk_values, flat[lo : lo + self.chunk], use_reentrant=False)
            for lo in range(0, flat.shape[0], self.chunk)
        ]
        return self._in_batch_layout(torch.cat(parts).view(self.hidden.shape[:-1]))

    def logits(self) -> torch.Tensor:
        """``[b, s, V/TP]`` this rank's logits, materialized (the ``full`` KL estimator)."""
        return self._in_batch_layout(self.fed @ self.weight.t())
