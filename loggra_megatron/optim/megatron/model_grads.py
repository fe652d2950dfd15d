"""Megatron optimizers that give LoGRA bf16 gradients without Megatron's fp32 copy.

With bf16 grad buffers, Megatron's ``DistributedOptimizer`` copies every gradient shard to
fp32 before the step (4 bytes per parameter of the DP shard, alive through the step). LoGRA
reads gradients one weight at a time, so ``ModelGradsMixin`` leaves the bf16 shards in
the grad buffer and hands them to ``ShardedLoGRAAdamW.set_model_grads``: the step holds at
most one weight's fp32 gradient. What Megatron does to main grads is redone on the same
values: the grad norm from each shard's fp32-accumulated norm, and the clipping factor
``c = clip_grad / (‖g‖ + 1e-6)`` applied to each fp32 conversion (``LoGRAChainedOptimizer``
sets it for a ``ChainedOptimizer``). Main params kept as remainders get their gradients this
way also from fp32 grad buffers, and Megatron's main → model copy is skipped for them.

Memory, norm and clipping in detail, when Megatron's copy is kept, and the megatron-core
functions this is pinned to (0.16–0.19): docs/optimizer.md#bf16-gradients-without-an-fp32-copy.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.transformer.module import param_is_not_shared

from loggra_megatron.optim.megatron.params import main_params_of


def clip_coefficient(clip_grad: float, grad_norm) -> float:
    """The factor Megatron's ``clip_grad_by_total_norm_fp32`` scales gradients by
    (``grad_norm`` is a float, or a 1-element tensor from megatron-core ≥ 0.17 with TE)."""
    if clip_grad <= 0.0:
        return 1.0
    coeff = clip_grad / (float(grad_norm) + 1.0e-6)
    return coeff if coeff < 1.0 else 1.0


class ModelGradsMixin(MegatronOptimizer):
    """For a ``DistributedOptimizer`` leaf whose inner optimizer is ``ShardedLoGRAAdamW``:
    bf16 gradient shards go to the inner optimizer uncopied (module docstring)."""

    __slots__ = ()

    def _keeps_model_grads(self) -> bool:
        config = self.config
        return not (
            self.loggra.loggra_fp32_grad_copy
            or self.grad_scaler is not None
            or config.log_num_zeros_in_grad
            or config.use_precision_aware_optimizer
        )

    def _copy_model_grads_to_main_grads(self) -> None:
        if not self._keeps_model_grads():
            super()._copy_model_grads_to_main_grads()
            return
        model_grads = {}
        for main, model, start, end in main_params_of(self):
            grad = model.main_grad.view(-1)[start:end]
            if grad.dtype == main.dtype == torch.float32:
                main.grad = grad  # what Megatron's .float() returns: a view
            else:
                main.grad = None
                model_grads[main] = grad
        self.optimizer.set_model_grads(model_grads)

    def _model_grad_norms(self) -> list[torch.Tensor]:
        """``[‖g‖₂]`` (fp32) of each handed-over grad shard that Megatron's norm counts."""
        return [
            torch.linalg.vector_norm(grad, dtype=torch.float32).reshape(1)
            for main, grad in self.optimizer.model_grads.items()
            if param_is_not_shared(main)
            and tensor_parallel.param_is_not_tensor_parallel_duplicate(main)
        ]

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:  # megatron-core ≤ 0.18
        return super().get_main_grads_for_grad_norm() + self._model_grad_norms()

    def get_grads_for_grad_norm(self, grad_norm_group=None) -> list[torch.Tensor]:  # ≥ 0.19
        extra = self._model_grad_norms() if grad_norm_group is None else []
        return super().get_grads_for_grad_norm(grad_norm_group) + extra

    def _copy_main_params_to_model_params(self) -> None:
        if not self.optimizer.param_remainders:
            super()._copy_main_params_to_model_params()
        # else every main param is a view of its model param (bf16 shards with remainders,
        # and Megatron's fp32 params): there is nothing to copy

    def _copy_model_params_to_main_params(self, state_dict=None) -> None:
        if not self.optimizer.param_remainders:
            super()._copy_model_params_to_main_params(state_dict)
            return
        for remainder in self.optimizer.param_remainders.values():
            remainder.zero_()  # the masters become the model weights exactly

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = super().clip_grad_norm(clip_grad)
        self.optimizer.model_grad_scale = clip_coefficient(clip_grad, grad_norm)
        return grad_norm


class LoGRAChainedOptimizer(ChainedOptimizer):
    """Megatron's ``ChainedOptimizer`` over LoGRA leaves: also tells each leaf's inner
    optimizer the clipping coefficient of the total norm it computes."""

    def get_grad_norm(self):
        grad_norm = super().get_grad_norm()
        for leaf in self.chained_optimizers:
            inner = getattr(leaf, "optimizer", None)
            if hasattr(inner, "model_grad_scale"):
                inner.model_grad_scale = clip_coefficient(leaf.config.clip_grad, grad_norm)
        return grad_norm
