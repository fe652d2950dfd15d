"""Optimizers: LoGRA-AdamW (low-rank gradient-sketch Adam) and its state accounting."""

from loggra_megatron.optim.loggra_adamw import LoGRAAdamW, state_bytes

__all__ = ["LoGRAAdamW", "state_bytes"]
