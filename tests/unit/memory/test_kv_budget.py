"""The rollout's KV budget where ``--inference-max-tokens`` is unset (``memory/kv_budget.py``):
the most rows of ``--seq-length`` tokens whose step fits the GPU by the memory model, the whole
batch where it fits, a warning where nothing fits; the environment's allocator and NCCL
settings count. (The trainer's call on CUDA, ``mem_get_info`` and the MIN all-reduce over
ranks, needs a GPU.)"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from memory_plans import plan

from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.memory.kv_budget import kv_budget
from loggra_megatron.memory.model import estimate_rl_step_memory
from loggra_megatron.memory.shape import GiB, TransformerShape

CONFIG_27B = os.path.join(str(Path(__file__).resolve().parents[3]), "tools", "configs")
CONFIG_27B = os.path.join(CONFIG_27B, "llama-style-27b.json")
ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_NVLS_ENABLE": "0"}


def _step(rows: int = 64):
    args = gpt_args_from_hf(CONFIG_27B)
    step = plan(
        tensor_model_parallel_size=8,
        seq_length=16384,
        max_new_tokens=15360,
        rollout_batch_size=rows,
        recompute_granularity="full",
        optimizer="loggra",
        loggra_sketch="backward",
    )
    return args, step


def _fits(args, step, tokens, usable, env=ENV) -> bool:
    from loggra_megatron.memory.estimate_config import EstimateConfig

    est = EstimateConfig(
        world_size=8,
        gpu_memory_gb=usable / GiB,
        expandable_segments=True,
        nccl_nvls=False,
        adam_implementation="foreach",
    )
    shape = TransformerShape.from_model_args(args)
    with_budget = dataclasses.replace(step, inference_max_tokens=tokens, rollout_engine="static")
    return estimate_rl_step_memory(shape, with_budget, est).fits(usable)


def test_the_budget_is_the_most_rows_that_fit():
    args, step = _step()
    usable = int(45 * GiB)
    tokens, note = kv_budget(args, step, usable, ENV)
    s = step.seq_length
    assert tokens is not None and tokens % s == 0
    rows = tokens // s
    assert 1 <= rows < step.rollout_batch_size
    assert _fits(args, step, tokens, usable)  # the chosen rows fit ...
    assert not _fits(args, step, tokens + s, usable)  # ... and one more does not
    assert f"{tokens} tokens ({rows} of 64 rows of 16384 at once)" in note
    assert "45.00 GiB usable" in note


def test_the_whole_batch_or_nothing():
    args, step = _step(rows=8)
    tokens, note = kv_budget(args, step, int(79 * GiB), ENV)
    assert tokens is None and "whole rollout (8 rows) fits" in note
    tokens, note = kv_budget(args, step, int(10 * GiB), ENV)
    assert tokens is None and note.startswith("warning: the step does not fit")


def test_the_environment_counts():
    """Without expandable segments a freed KV buffer's segment stays pinned (the estimator's
    fragmentation term), with NVLS its buffers: fewer rows fit."""
    args, step = _step()
    usable = int(45 * GiB)
    tokens = kv_budget(args, step, usable, ENV)[0]
    assert kv_budget(args, step, usable, {**ENV, "PYTORCH_CUDA_ALLOC_CONF": ""})[0] < tokens
    assert kv_budget(args, step, usable, {**ENV, "NCCL_NVLS_ENABLE": "1"})[0] < tokens
    # PyTorch's newer name wins where set
    newer = {**ENV, "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert kv_budget(args, step, usable, newer)[0] < tokens


def test_with_generation_ranks_the_budget_is_a_generation_gpus():
    """--generation-ranks: the training GPUs hold no KV cache, so the budget is sized for a
    generation GPU (weights at its TP, no optimizer): the most rows of its replica's share
    whose rollout fits it, where a colocated training GPU at the same TP fits no step."""
    from loggra_megatron.memory.estimate_config import EstimateConfig
    from loggra_megatron.memory.model import estimate_generation_memory

    args, step = _step(rows=64)
    split = dataclasses.replace(step, generation_ranks=16, generation_tensor_model_parallel_size=8)
    assert split.generating_rows == 32  # the 64 rollouts over 2 generation replicas
    usable = int(20 * GiB)
    tokens, note = kv_budget(args, split, usable, ENV)
    s = split.seq_length
    assert tokens is not None and tokens % s == 0 and "of 32 rows" in note
    rows = tokens // s
    est = EstimateConfig(gpu_memory_gb=20, expandable_segments=True, nccl_nvls=False)
    shape = TransformerShape.from_model_args(args)

    def gen_fits(r: int) -> bool:
        budget = dataclasses.replace(split, inference_max_tokens=r * s, rollout_engine="static")
        return estimate_generation_memory(shape, budget, est).fits(usable)

    assert gen_fits(rows) and not gen_fits(rows + 1)
    colocated, warning = kv_budget(args, step, usable, ENV)
    assert colocated is None and "does not fit" in warning
