# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""The memory estimator's own settings (``EstimateConfig``): what a ``pretrain_rl.py``
command line cannot say about the run it would start (the machine it runs on, the
architecture without a checkpoint or tokenizer, the precision-aware optimizer's what-ifs)
and how to print. Every other flag of ``tools/estimate_memory.py`` is ``pretrain_rl.py``'s,
generated from the same settings sections with the same defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass

from loggra_megatron.config import applies, check_fields, one_of, positive, reject
from loggra_megatron.memory.capacity import H100_80GB_CAPACITY_GIB, RUNTIME_OVERHEAD_GIB

MOMENT_DTYPES = ("fp32", "bf16")


ADAM_IMPLEMENTATIONS = ("fused", "foreach", "single")
"""``--adam-implementation`` choices."""


@dataclass
class EstimateConfig:
    """The machine, the architecture's source and the output (flags ``pretrain_rl.py`` does
    not have)."""

    hf_config: str | None = None
    """A Hugging Face config.json (or its directory) of Llama / Qwen2 / Qwen3: the
    architecture of the converted model the run loads (tools/configs/ has some); the
    architecture flags are then not allowed."""
    vocab_size: int | None = None
    """Without --hf-config: the tokenizer's vocabulary (pretrain_rl.py reads it from
    --tokenizer-model, which the estimator does not)."""
    make_vocab_size_divisible_by: int | None = None
    """Megatron pads the vocabulary to a multiple of this × TP (default: 128 with
    --hf-config, tools/convert_checkpoint.py's; 64 for a model made from scratch,
    pretrain_rl.py's)."""
    world_size: int | None = None
    """GPUs of the run (torchrun's world); data-parallel size = world / (TP × PP) (default:
    --num-nodes × --gpus-per-node, else TP × PP, one replica)."""
    num_nodes: int | None = None
    """Nodes of the run, --gpus-per-node GPUs each: the world when --world-size is not given
    (--fit: 1 by default)."""
    gpu_memory_gb: float = H100_80GB_CAPACITY_GIB
    """GiB per GPU the verdict is against: what PyTorch and NCCL can allocate, the GPU's
    memory less the CUDA context (default 79.1: an H100 80GB; loggra_megatron/memory/
    capacity.py)."""
    gpus_per_node: int = 8
    """GPUs of one node (which communicators stay inside it: NCCL's NVLS buffers)."""
    runtime_overhead_gb: float = RUNTIME_OVERHEAD_GIB
    """cuBLAS/Transformer Engine workspaces and the like, GiB, counted inside
    --gpu-memory-gb (NCCL's buffers are counted apart, the CUDA context is outside it)."""
    nccl_nvls: bool = True
    """NCCL's NVLink SHARP buffers (NCCL's default on NVSwitch nodes; --no-nccl-nvls is
    NCCL_NVLS_ENABLE=0)."""
    expandable_segments: bool = False
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (without it a freed KV buffer's
    segment may stay pinned: counted once more in the rollout)."""
    exp_avg_dtype: str = "fp32"
    """Dense Adam's first moment: fp32 | bf16 (bf16: Megatron's
    --use-precision-aware-optimizer, Transformer Engine's FusedAdam, which then keeps the
    masters as remainders too; read for the optimizers the registry marks precision_aware)."""
    exp_avg_sq_dtype: str = "fp32"
    """Dense Adam's second moment: fp32 | bf16 (as --exp-avg-dtype)."""
    adam_implementation: str = "fused"
    """Dense Adam's kernel, which Megatron picks by what is installed: fused (Transformer
    Engine's or apex's FusedAdam: no temporaries) | foreach (torch.optim.AdamW on a GPU
    without them: one fp32 temporary per element of the shard, its square-root term) |
    single (torch's per-tensor loop, the CPU's: two fp32 temporaries of the largest
    shard). LoGRA's own update is counted as it runs."""
    fit: bool = False
    """Instead of one run: search the layouts (TP within a node, PP), recompute, micro-batch
    sizes, bf16 grads and LoGRA's remainders that fit, with the largest KV budget each
    leaves, for dense Adam and LoGRA; a flag given fixes its value (docs/memory.md, "What
    fits my node")."""
    fit_top: int = applies(5, "with --fit", lambda s: s["fit"])
    """How many fitting configurations --fit prints per optimizer (best first, the best one
    of each TP × PP layout and recompute)."""
    fit_headroom_gb: float = applies(1.0, "with --fit", lambda s: s["fit"])
    """GiB per GPU a configuration --fit prints must leave free (within about 1 GiB of the
    GPU's memory the model's verdict is not to be trusted: docs/memory.md)."""
    json: bool = False
    """Print the numbers as JSON (GiB) instead of the table."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("vocab_size", positive, ">= 1"),
                ("make_vocab_size_divisible_by", positive, ">= 1"),
                ("world_size", positive, ">= 1"),
                ("num_nodes", positive, ">= 1"),
                ("fit_top", positive, ">= 1"),
                ("fit_headroom_gb", lambda v: v >= 0, ">= 0"),
                ("gpu_memory_gb", positive, "> 0"),
                ("gpus_per_node", positive, ">= 1"),
                ("runtime_overhead_gb", lambda v: v >= 0, ">= 0"),
                ("exp_avg_dtype", one_of(*MOMENT_DTYPES), f"one of {', '.join(MOMENT_DTYPES)}"),
                ("exp_avg_sq_dtype", one_of(*MOMENT_DTYPES), f"one of {', '.join(MOMENT_DTYPES)}"),
                (
                    "adam_implementation",
                    one_of(*ADAM_IMPLEMENTATIONS),
                    f"one of {', '.join(ADAM_IMPLEMENTATIONS)}",
                ),
            ],
        )
        if self.hf_config is not None and not os.path.exists(self.hf_config):
            reject("hf_config", self.hf_config, "no such file or directory")
        if self.num_nodes is not None and self.world_size is not None:
            reject("num_nodes", self.num_nodes, "give --world-size or --num-nodes, not both")

    def world(self, tensor_parallel: int, pipeline_parallel: int, generation: int = 0) -> int:
        """The world size: ``--world-size``, else ``--num-nodes`` (with ``--fit``: 1) ×
        ``--gpus-per-node``, else TP × PP (one replica) and the ``generation`` ranks."""
        nodes = self.num_nodes or (1 if self.fit else None)
        if self.world_size or not nodes:
            return self.world_size or tensor_parallel * pipeline_parallel + generation
        return nodes * self.gpus_per_node
