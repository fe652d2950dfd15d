"""Optimizers, in two wings: the gradient sketch (``optim.gradient_sketch``: LoGRA-AdamW
and its data-parallel sharded form) and the backward sketch (``optim.backward_sketch``:
LoGRA as published, RowAdam), both torch only; their integration into Megatron-Core's
optimizers (``optim.megatron``), the registry behind ``--optimizer`` and
``--loggra-sketch`` (``optim.registry``) and state accounting.

Names are imported on first use, so that the registry and the settings load without torch
and the torch-only math without megatron-core (``state_bytes`` takes a torch or a Megatron
optimizer, so it imports megatron-core).
"""

from importlib import import_module

_EXPORTS = {
    "LoGRAAdamW": "loggra_megatron.optim.gradient_sketch.adamw",
    "state_bytes": "loggra_megatron.optim.megatron.optimizer_state",
    "LoGRAConfig": "loggra_megatron.optim.config",
    "OptimConfig": "loggra_megatron.optim.config",
    "prepare_model": "loggra_megatron.optim.megatron.factory",
    "get_loggra_optimizer": "loggra_megatron.optim.megatron.factory",
    "OPTIMIZERS": "loggra_megatron.optim.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'loggra_megatron.optim' has no attribute {name!r}")
