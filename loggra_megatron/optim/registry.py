"""The optimizers ``pretrain_rl.py`` can train with (``--optimizer``), by name.

Each :class:`OptimizerSpec` says how to build the Megatron-Core optimizer and how its state
is laid out, for the trainer (:func:`build`), the flag's choices and the memory model
(``loggra_megatron.memory``). Imports neither torch nor Megatron; builders are imported when
called. Adding an optimizer variant: one builder module, one line in :data:`OPTIMIZERS`
(``docs/architecture.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    description: str
    builder: str
    """``"module:function"``: ``function(optim, loggra, model_chunks) -> MegatronOptimizer``
    with the ``OptimConfig`` and ``LoGRAConfig`` sections."""
    sketched: bool
    """Adam's moments of 2-D transformer weights live in low-rank sketches (else dense)."""
    grads_per_weight: bool
    """With bf16 grad buffers it converts one weight's gradient at a time to fp32 (else
    Megatron copies every shard before the step)."""

    def build(self, optim, loggra, model_chunks):
        module, _, function = self.builder.partition(":")
        return getattr(import_module(module), function)(optim, loggra, model_chunks)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adam": OptimizerSpec(
        "adam", "Megatron's dense (distributed) Adam",
        "loggra_megatron.optim.megatron.factory:build_dense_adam",
        sketched=False, grads_per_weight=False,
    ),
    "loggra": OptimizerSpec(
        "loggra", "LoGRA: Adam's moments in low-rank gradient sketches",
        "loggra_megatron.optim.megatron.factory:build_loggra",
        sketched=True, grads_per_weight=True,
    ),
}  # fmt: skip


def sketches_shape(shape: tuple[int, ...], min_dim: int) -> bool:
    """LoGRA's default rule for a transformer weight: 2-D with both sides ≥ ``min_dim`` (the
    projections' :meth:`~loggra_megatron.optim.projection.Projection.sketches` and the memory
    model use it)."""
    return len(shape) == 2 and min(shape) >= min_dim
