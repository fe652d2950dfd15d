"""The LoGRA classes of Megatron-Core's optimizers.

``get_loggra_optimizer`` builds Megatron's own
optimizers, puts ``ShardedLoGRAAdamW`` inside each leaf and re-classes the leaf (and a
``ChainedOptimizer`` over leaves) to the matching class here. The classes add no slots, so
they share the instance layout of the Megatron class they derive from; the factory sets two
attributes on each leaf, ``loggra`` (the ``LoGRAConfig``, beside Megatron's ``config``) and
``loggra_params`` (the sketched weights' keys and shards). What the classes add:

* ``LoGRACheckpointMixin``: ``dist_checkpointing``
  of sketch state (every leaf);
* ``ModelGradsMixin``: bf16 gradients handed to
  LoGRA without Megatron's fp32 copy (``DistributedOptimizer`` only), with
  ``LoGRAChainedOptimizer`` for the chain.
"""

from __future__ import annotations

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
)

from loggra_megatron.optim.megatron.checkpoint import LoGRACheckpointMixin
from loggra_megatron.optim.megatron.model_grads import LoGRAChainedOptimizer, ModelGradsMixin

__all__ = ["LoGRAChainedOptimizer", "loggra_class_for"]


class LoGRADistributedOptimizer(LoGRACheckpointMixin, ModelGradsMixin, DistributedOptimizer):
    """Megatron's ``DistributedOptimizer`` with LoGRA as its inner optimizer."""

    __slots__ = ()


class LoGRAFloat16Optimizer(LoGRACheckpointMixin, Float16OptimizerWithFloat16Params):
    """Megatron's ``Float16OptimizerWithFloat16Params`` with LoGRA as its inner optimizer."""

    __slots__ = ()


class LoGRAFP32Optimizer(LoGRACheckpointMixin, FP32Optimizer):
    """Megatron's ``FP32Optimizer`` with LoGRA as its inner optimizer."""

    __slots__ = ()


_CLASSES = {
    DistributedOptimizer: LoGRADistributedOptimizer,
    Float16OptimizerWithFloat16Params: LoGRAFloat16Optimizer,
    FP32Optimizer: LoGRAFP32Optimizer,
    ChainedOptimizer: LoGRAChainedOptimizer,
}


def loggra_class_for(cls: type) -> type:
    """The ``LoGRA*`` subclass for a Megatron optimizer class."""
    if cls not in _CLASSES:
        raise TypeError(f"LoGRA cannot wrap Megatron optimizer class {cls.__name__}")
    return _CLASSES[cls]
