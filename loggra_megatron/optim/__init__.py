"""Optimizers: LoGRA-AdamW (low-rank gradient-sketch Adam), its data-parallel sharded form,
its integration into Megatron-Core's optimizers, and state accounting.

The Megatron-facing names (``LoGRAOptimizerConfig``, ``get_loggra_optimizer``) are imported
lazily so that the torch-only math modules work without megatron-core.
"""

from loggra_megatron.optim.loggra_adamw import LoGRAAdamW, state_bytes

__all__ = ["LoGRAAdamW", "LoGRAOptimizerConfig", "get_loggra_optimizer", "state_bytes"]


def __getattr__(name):
    if name in ("LoGRAOptimizerConfig", "get_loggra_optimizer"):
        from loggra_megatron.optim import megatron_adapter

        return getattr(megatron_adapter, name)
    raise AttributeError(f"module 'loggra_megatron.optim' has no attribute {name!r}")
