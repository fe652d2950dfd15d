# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The GPU capacity the estimator's verdicts are against, and what is counted inside it: the
constants, in one place (pure arithmetic, no torch).

``capacity = total − CUDA context``: the device memory CUDA reports (``cudaMemGetInfo``'s
total, ``torch.cuda.mem_get_info()[1]``) less the CUDA context, which the driver allocates
outside every allocator as the process first touches the GPU (its own state and the module
images of the kernels it loads). What is left is what the process's allocations can share:
PyTorch's caching allocator and NCCL's own ``cudaMalloc``. The estimate's total is compared
with it, so whatever else takes device memory is a *term* of the estimate, not a deduction
from the capacity: cuBLAS/cuBLASLt and Transformer Engine workspaces (PyTorch's allocator;
the flat ``runtime overhead``, ``RUNTIME_OVERHEAD_GIB``) and NCCL's ring and NVLS
buffers (``.runtime``).

For an H100 SXM 80GB (``H100_80GB_CAPACITY_GIB``, the default of ``--gpu-memory-gb``):
81559 MiB of total (79.65 GiB, what ``nvidia-smi`` and ``torch.cuda.mem_get_info`` report)
less a CUDA context of about 560 MiB (CUDA 12 with lazy module loading, PyTorch's default)
is 79.1 GiB. The context's size is an assumption, not measured by this project; it varies
with the driver, the CUDA release and the kernels loaded: a run can check it as
``total − free − torch.cuda.memory_reserved()`` right after its first CUDA call.
"""

from __future__ import annotations

from loggra_megatron.memory.shape import GiB

MiB = 1024**2

H100_80GB_TOTAL_MIB = 81559
"""Device memory of an H100 SXM 80GB as CUDA reports it (HBM3, less what the driver keeps)."""
CUDA_CONTEXT_MIB = 560
"""The CUDA context of a PyTorch process on Hopper (CUDA 12, lazy module loading): driver
state and loaded kernel images, outside PyTorch's allocator (an assumption)."""
H100_80GB_CAPACITY_GIB = round((H100_80GB_TOTAL_MIB - CUDA_CONTEXT_MIB) * MiB / GiB, 1)
"""What the process can allocate on an H100 80GB: 79.1 GiB (``--gpu-memory-gb``'s default)."""
RUNTIME_OVERHEAD_GIB = 2.0
"""Counted inside the capacity: cuBLAS/cuBLASLt and Transformer Engine workspaces, the
allocator's rounding and the like (``--runtime-overhead-gb``'s default; NCCL's buffers are
terms of their own)."""


def capacity_line(gpu_bytes: int, runtime_overhead_bytes: int) -> str:
    """The report's line saying what the capacity is and what is counted inside it."""
    return (
        f"capacity  {gpu_bytes / GiB:g} GiB per GPU (--gpu-memory-gb): what PyTorch and NCCL "
        f"can allocate, the GPU's memory less the CUDA context (an H100 80GB: "
        f"{H100_80GB_TOTAL_MIB * MiB / GiB:.2f} - {CUDA_CONTEXT_MIB * MiB / GiB:.2f} = "
        f"{H100_80GB_CAPACITY_GIB:g}); counted inside it: runtime overhead "
        f"{runtime_overhead_bytes / GiB:.2f} (cuBLAS/TE workspaces), NCCL's buffers"
    )
