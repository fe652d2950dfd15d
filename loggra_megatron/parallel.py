"""Process-group and Megatron parallel-state initialisation, shared by the trainer, the
benchmarks, the conversion tool and the test harness."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loggra_megatron.config import check_fields, one_of, positive


@dataclass
class ParallelConfig:
    """Model parallelism and the device (data parallelism is the rest of the world)."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    device: str = "auto"
    """cpu (gloo, CPU mode for megatron-core) | cuda (NCCL) | auto."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("tensor_model_parallel_size", positive, ">= 1"),
                ("pipeline_model_parallel_size", positive, ">= 1"),
                ("device", one_of("auto", "cpu", "cuda"), "one of auto, cpu, cuda"),
            ],
        )

    def uses_cuda(self, cuda_visible: bool) -> bool:
        """The run computes on a CUDA device: ``--device cuda``, or ``auto`` where one is
        visible (``cuda_visible``)."""
        return self.device == "cuda" or (self.device == "auto" and cuda_visible)


def single_process_env() -> None:
    """Outside torchrun (no ``RANK``): a one-process world on 127.0.0.1. Its store listens on
    port 0, a port the kernel picks as it binds (no other rank needs to know it), so two such
    runs on a machine never collide, not even in the moment between choosing a port and
    listening on it."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")


def initialize_megatron(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    device: str = "auto",
    timeout_s: float | None = None,
) -> torch.device:
    """Process groups (gloo + CPU mode on CPU, NCCL on GPU; torchrun's env or a single
    process), Megatron's parallel state and its RNG (which also seeds torch's default
    generator). ``timeout_s``: of the process group's collectives (default: torch's).
    Returns the compute device."""
    from megatron.core import parallel_state, tensor_parallel

    from loggra_megatron.cpu import enable_cpu_megatron

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        enable_cpu_megatron()
    if not dist.is_initialized():
        single_process_env()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            **({"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
