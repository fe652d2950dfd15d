# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The terms of ``memory.model`` that are not tensors of the step: NCCL's
communicator buffers (NVLink SHARP included) and the caching allocator's fragmentation
(pure arithmetic, no torch).

The constants, their sources and what the two launch-script settings
(``NCCL_NVLS_ENABLE=0``, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) change:
``docs/memory.md`` ("Runtime terms").
"""

from __future__ import annotations

from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.train.step_plan import StepPlan

__all__ = [
    "NCCL_CHANNELS",
    "NCCL_FIFO_BYTES",
    "NVLS_BYTES_PER_LOCAL_RANK",
    "communicators",
    "fragmentation_bytes",
    "nccl_buffer_bytes",
    "nvls_buffer_bytes",
]

NCCL_STEPS = 8
# One connection's FIFOs at NCCL's defaults: Simple (NCCL_BUFFSIZE, 4 MiB), LL128
# (120 elements x 640 threads x 8 steps x 8 B) and LL (8 lines x 512 threads x 8 steps x 16 B).
NCCL_FIFO_BYTES = (4 << 20) + 120 * 640 * NCCL_STEPS * 8 + 8 * 512 * NCCL_STEPS * 16
NCCL_CHANNELS = 32
"""Collective channels per communicator, each with one ring connection's FIFOs on this GPU."""
# NVLS (NVLink SHARP, NVSwitch + Hopper): nvlsTotalSize = 16 channels (NVLS_NCHANNELS_SM90)
# x 2 x (NCCL_NVLS_CHUNKSIZE 128 KiB x 8 steps) for each GPU of the node in the communicator.
NVLS_BYTES_PER_LOCAL_RANK = 16 * 2 * (128 * 1024 * NCCL_STEPS)


def _local(size: int, stride: int, gpus_per_node: int) -> int:
    """Ranks of a group of ``size`` ranks ``stride`` apart that share one node."""
    return min(size, max(1, gpus_per_node // stride))


def communicators(plan: StepPlan, gpus_per_node: int) -> list[tuple[str, int, int]]:
    """``(group, ranks, ranks on this GPU's node)`` of every NCCL communicator with more than
    one rank that an RL step drives on this GPU, for Megatron's rank order (TP innermost,
    then DP, then PP): the world (the stop agreement), TP, PP, this project's DP group and
    Megatron's DP group (its DDP; a separate communicator), and the group of the gradient-norm
    all-reduce (the distributed optimizer's instance = the world, else TP x PP), with
    ``gpus_per_node`` GPUs per node."""
    t, p, d = (
        plan.tensor_model_parallel_size,
        plan.pipeline_model_parallel_size,
        plan.data_parallel_size,
    )
    g, w = gpus_per_node, plan.world_size
    node = min(w, g)
    groups = [
        ("world", w, node),
        ("tensor", t, _local(t, 1, g)),
        ("pipeline", p, _local(p, t * d, g)),
        ("data", d, _local(d, t, g)),
        ("data (Megatron DDP)", d, _local(d, t, g)),
    ]
    if plan.distributed_optimizer:
        groups.append(("distributed-optimizer instance", w, node))
    else:
        groups.append(("model", t * p, _local(t, 1, g) * _local(p, t * d, g)))
    return [group for group in groups if group[1] > 1]


def nccl_buffer_bytes(plan: StepPlan, est: EstimateConfig) -> int:
    """Ring buffers of every communicator: ``NCCL_CHANNELS x NCCL_FIFO_BYTES`` each."""
    comms = communicators(plan, est.gpus_per_node)
    return len(comms) * NCCL_CHANNELS * NCCL_FIFO_BYTES


def nvls_buffer_bytes(plan: StepPlan, est: EstimateConfig) -> int:
    """NVLS buffers (``--nccl-nvls``) of the communicators with at least two GPUs of the
    node: ``NVLS_BYTES_PER_LOCAL_RANK`` per such GPU."""
    if not est.nccl_nvls:
        return 0
    comms = communicators(plan, est.gpus_per_node)
    return sum(NVLS_BYTES_PER_LOCAL_RANK * local for _, _, local in comms if local >= 2)


def fragmentation_bytes(est: EstimateConfig, kv_bytes: int) -> int:
    """What the caching allocator may be unable to hand to the next step's KV cache: without
    expandable segments, the freed KV buffer's whole segment, pinned by any tensor allocated
    in it after generation (the worst case); with them, freed pages are unmapped and
    remapped, so nothing of this size (0)."""
    return 0 if est.expandable_segments else kv_bytes
