"""Where a Megatron leaf optimizer keeps each parameter's fp32 master (pinned internals).

:func:`main_params_of` pairs every main (master) param with the model param it updates:
``DistributedOptimizer`` (``model_float16_groups`` / ``shard_fp32_from_float16_groups``,
``model_fp32_groups`` / ``shard_fp32_groups`` and ``_get_model_param_range_map``),
``Float16OptimizerWithFloat16Params`` (``float16_groups`` / ``fp32_from_float16_groups``,
``fp32_from_fp32_groups``) and ``FP32Optimizer`` (the model params are the main params).
Read the same in megatron-core 0.16-0.19; covered by ``tests/test_megatron_optimizer.py``.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def main_params_of(leaf) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """``(main param, model param, start, end)`` for each main param of a Megatron leaf
    optimizer: the main param holds ``model_param.view(-1)[start:end]`` in fp32 (for fp32
    model params it *is* that view)."""
    if isinstance(leaf, DistributedOptimizer):
        groups = [
            *zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups, strict=True),
            *zip(leaf.model_fp32_groups, leaf.shard_fp32_groups, strict=True),
        ]
        out = []
        for model_group, main_group in groups:
            for model, main in zip(model_group, main_group, strict=True):
                r = leaf._get_model_param_range_map(model)["param"]
                out.append((main, model, r.start, r.end))
        return out
    if hasattr(leaf, "float16_groups"):  # Float16OptimizerWithFloat16Params
        groups = [
            *zip(leaf.float16_groups, leaf.fp32_from_float16_groups, strict=True),
            *zip(leaf.fp32_from_fp32_groups, leaf.fp32_from_fp32_groups, strict=True),
        ]
    else:  # FP32Optimizer: the model params are the main params
        groups = [(g["params"], g["params"]) for g in leaf.optimizer.param_groups]
    return [
        (main, model, 0, model.numel())
        for model_group, main_group in groups
        for model, main in zip(model_group, main_group, strict=True)
    ]


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a main param *is* (a view of) its model param (fp32 model params)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
