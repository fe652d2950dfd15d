"""Where a Megatron leaf optimizer keeps each parameter's fp32 master (pinned internals).

``main_params_of`` pairs every main (master) param with the model param it updates:
``DistributedOptimizer`` (``model_float16_groups`` / ``shard_fp32_from_float16_groups``,
``model_fp32_groups`` / ``shard_fp32_groups`` and ``_get_model_param_range_map``),
``Float16OptimizerWithFloat16Params`` (``float16_groups`` / ``fp32_from_float16_groups``,
``fp32_from_fp32_groups``) and ``FP32Optimizer`` (the model params are the main params).
Read the same in megatron-core 0.16-0.19; covered by ``tests/integration/test_megatron_optimizer.py``.

``keep_masters_as_remainders`` (``--loggra-param-remainders``) swaps a
``DistributedOptimizer``'s fp32 master shards of 16-bit params for the model's own bf16
shards (``shard_float16_groups``, views of the param buffer) everywhere Megatron keeps them
(``shard_fp32_from_float16_groups``, the inner optimizer's param groups and the
``opt_group_ranges`` they were made from, ``main_param``), so
that the fp32 copies are freed; the inner optimizer keeps an int16 remainder per element
(``optim.param_remainders``). Megatron's precision-aware optimizer
does the same swap for Transformer Engine's FusedAdam.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def main_params_of(leaf) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """``(main param, model param, start, end)`` for each main param of a Megatron leaf
    optimizer: the main param holds ``model_param.view(-1)[start:end]`` in fp32 (for fp32
    model params it *is* that view). A leaf of LoGRA's own (the backward sketch's) says so
    itself (``main_params()``)."""
    if hasattr(leaf, "main_params"):
        return leaf.main_params()
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


def keep_masters_as_remainders(leaf: DistributedOptimizer) -> dict[torch.Tensor, torch.Tensor]:
    """Replace ``leaf``'s fp32 master shards of bf16 params by the model's bf16 shards and
    return ``{bf16 shard: int16 remainder}`` (zeros: Megatron made the masters from the
    bf16 weights, so each master equals its weight). Call before the first step."""
    remainders, swap = {}, {}
    groups = zip(leaf.shard_float16_groups, leaf.shard_fp32_from_float16_groups, strict=True)
    for shard_group, main_group in groups:
        for i, (shard, main) in enumerate(zip(shard_group, main_group, strict=True)):
            if shard.dtype != torch.bfloat16:
                raise ValueError(
                    f"--loggra-param-remainders needs bf16 parameters, found {shard.dtype}"
                )
            swap[id(main)] = shard
            main_group[i] = shard
            remainders[shard] = torch.zeros(shard.shape, dtype=torch.int16, device=shard.device)
    orig_groups = [g["orig_group"] for g in leaf.opt_group_ranges]  # the inner groups' origin
    for group in [*leaf.optimizer.param_groups, *orig_groups]:
        group["params"] = [swap.get(id(p), p) for p in group["params"]]
    for model_group in leaf.model_float16_groups:
        for model in model_group:
            if id(getattr(model, "main_param", None)) in swap:
                model.main_param = swap[id(model.main_param)]
    return remainders
