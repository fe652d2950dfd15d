"""The rollout's KV budget where ``--inference-max-tokens`` is unset, from the memory model and
this GPU's memory (the trainer's ``KVBudgetFn``, given to it by ``pretrain_rl.py``).

Without a budget the rollout holds every one of a replica's ``B`` sequences at once, which on
a GPU may not fit beside the weights, grads and optimizer state. At start-up on CUDA the
trainer asks the memory model (``max_rollout_batch_size``,
what ``tools/estimate_memory.py`` prints as "max rollout rows at once") how many rows of
``--seq-length`` tokens the step leaves room for in what this process can allocate (the
device's free memory plus what PyTorch's allocator already holds, measured after the models
are built), with the allocator and NCCL settings of its environment:

* all ``B`` fit: no bound (the whole rollout in one batch);
* ``R < B`` fit: a budget of ``R × seq_length`` tokens, printed;
* not even the step without rollout fits: no bound, and a warning.

``--inference-max-tokens`` given always wins. On CPU there is nothing to size.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.model import max_rollout_batch_size
from loggra_megatron.memory.shape import GiB, TransformerShape
from loggra_megatron.train.preflight import expandable_segments, nccl_nvls
from loggra_megatron.train.step_plan import StepPlan

__all__ = ["kv_budget"]


def kv_budget(
    model_args, plan: StepPlan, usable_bytes: int, env: Mapping[str, str]
) -> tuple[int | None, str]:
    """``(tokens, note)``: the KV budget of ``plan``'s rollout (its ``inference_max_tokens`` unset) for a model of
    ``model_args`` (``GPTModelArgs``) in ``usable_bytes`` per GPU, the environment ``env``
    deciding the allocator's and NCCL's terms (as ``train.preflight.environment_note``);
    ``tokens`` None: no bound; ``note``: the line the trainer prints."""
    shape = TransformerShape.from_model_args(model_args)
    fused_adam = any(importlib.util.find_spec(m) for m in ("transformer_engine", "apex"))
    est = EstimateConfig(
        world_size=plan.world_size,
        gpu_memory_gb=usable_bytes / GiB,
        expandable_segments=expandable_segments(env),
        nccl_nvls=nccl_nvls(env),
        adam_implementation="fused" if fused_adam else "foreach",
    )
    rows = max_rollout_batch_size(shape, plan, est, usable_bytes)
    batch, seq = plan.generating_rows, plan.seq_length
    where = f"by the memory model for {usable_bytes / GiB:.2f} GiB usable on this GPU"
    if rows is None:
        return (
            None,
            f"warning: the step does not fit {where} even without a rollout; the rollout is "
            "not bounded (set --inference-max-tokens, or see tools/estimate_memory.py --fit)",
        )
    if rows >= batch:
        return None, f"the whole rollout ({batch} rows) fits at once, {where}"
    rows = max(rows, 1)
    return (
        rows * seq,
        f"--inference-max-tokens unset: a KV budget of {rows * seq} tokens ({rows} of {batch} "
        f"rows of {seq} at once), {where}",
    )
