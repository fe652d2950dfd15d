# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Per-GPU memory of one RL step with dense Adam and with LoGRA, side by side.

The model is :mod:`loggra_megatron.memory.model` (its docstring states every formula and
assumption). Give the architecture as a Hugging Face ``config.json`` (Llama / Qwen2 / Qwen3;
small ones ship in ``tools/configs/``) or with Megatron-LM's flags::

    python tools/estimate_memory.py --hf-config tools/configs/llama-style-27b.json \\
        --tensor-model-parallel-size 8 --sequence-parallel --world-size 8 \\
        --micro-batch-size 1 --seq-length 8192 --bf16 --loggra-rank 128 \\
        --rollout-batch-size 64 --gpu-memory-gb 79.1 --expandable-segments --no-nccl-nvls

    python tools/estimate_memory.py --num-layers 32 --hidden-size 4096 \\
        --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8 \\
        --vocab-size 128256 --untie-embeddings-and-output-weights --world-size 8 ...

The step flags are ``pretrain_rl.py``'s, same names and meaning, so a launch script's memory
flags can be passed as they are (``examples/h100_8gpu/train_27b_loggra.sh`` lists its
command): ``--bf16`` (without it fp32, and ``--rollout-engine auto`` is then the static
engine), ``--fp8-format``, ``--sequence-parallel``, ``--recompute-granularity/-method/
-num-layers``, ``--grad-reduce-in-bf16``, ``--prompts-per-step`` x ``--num-generations`` (the
rollout batch, / DP), ``--rollout-engine``, ``--inference-max-tokens`` (the KV budget:
min(rollout rows x --seq-length, it) tokens; the dynamic engine's prefill step),
``--log-prob-micro-batch-size`` (the reference forward and the dynamic engine's old-log-prob
recompute), ``--global-batch-size``, ``--kl-target --kl-probe-fraction --kl-estimator`` (the
probe) and ``--kl-coef`` (0: no reference model). The launch environment has flags of its
own: ``--expandable-segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``),
``--no-nccl-nvls`` (``NCCL_NVLS_ENABLE=0``) and ``--gpus-per-node``.

Sizes are GiB (2^30 bytes); ``--gpu-memory-gb 79.1`` is what PyTorch can allocate on an
A100/H100 80GB. Invalid input exits with status 2 and a message
naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from loggra_megatron.memory.model import (
    GiB,
    MemoryConfigError,
    ParallelConfig,
    RLStepConfig,
    TransformerShape,
    estimate_rl_step_memory,
)
from loggra_megatron.memory.report import report
from loggra_megatron.optim.registry import OPTIMIZERS
from loggra_megatron.rollout.protocol import EngineTarget
from loggra_megatron.rollout.registry import engine_choices, select_engine

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")

_SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
)


def _int(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _number(allow_zero: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not (value >= 0 if allow_zero else value > 0):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if allow_zero else '>'} 0, got {value}"
            )
        return value

    return parse


_float = _number()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    pos, nonneg = _int(1), _int(0)
    m = p.add_argument_group("model (an HF config.json, or the Megatron-LM flags)")
    m.add_argument("--hf-config", metavar="PATH", help="Hugging Face config.json (or its dir)")
    for name in _SHAPE_FLAGS:
        m.add_argument("--" + name.replace("_", "-"), type=pos, default=None)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    m.add_argument(
        "--swiglu",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gated SiLU MLP (default: on, as Llama/Qwen)",
    )
    m.add_argument("--add-qkv-bias", action="store_true", default=None)
    m.add_argument("--qk-layernorm", action="store_true", default=None)
    m.add_argument("--make-vocab-size-divisible-by", type=pos, default=128)

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=pos, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=pos, default=1)
    par.add_argument(
        "--virtual-pipeline-model-parallel-size", type=pos, default=None, help="ignored"
    )
    dp = par.add_mutually_exclusive_group()
    dp.add_argument("--data-parallel-size", type=pos, default=None)
    dp.add_argument("--world-size", type=pos, default=None, help="GPUs; DP = world / (TP·PP)")
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument(
        "--use-distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ZeRO-1: master params and optimizer state split over DP",
    )

    s = p.add_argument_group("step (pretrain_rl.py's names)")
    s.add_argument("--micro-batch-size", type=pos, default=1)
    s.add_argument("--seq-length", type=pos, default=4096, help="prompt + response tokens")
    s.add_argument("--max-new-tokens", type=pos, default=None, help="counts the prefill")
    s.add_argument("--num-microbatches", type=pos, default=None, help="default: >= PP")
    s.add_argument(
        "--global-batch-size", type=pos, default=None, help="sets micro-batches and KL probe"
    )
    s.add_argument("--bf16", action="store_true", help="bf16 params (without it: fp32)")
    s.add_argument(
        "--fp8-format", choices=["hybrid", "e4m3"], help="FP8 GEMMs (TE, Hopper; needs --bf16)"
    )
    s.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="tensorwise")
    s.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="auto")
    s.add_argument("--main-grads-dtype", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--grad-reduce-in-bf16", action="store_true", help="= --main-grads-dtype bf16")
    s.add_argument("--loggra-fp32-grad-copy", action="store_true")
    s.add_argument(
        "--loggra-param-remainders",
        action="store_true",
        help="LoGRA: fp32 masters as bf16 weights + int16 remainders (2 B instead of 4)",
    )
    s.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="loggra",
        help="the optimizer the run uses (marked *); dense Adam and LoGRA are always shown",
    )
    s.add_argument("--loggra-rank", type=pos, default=128)
    s.add_argument("--loggra-min-dim", type=pos, default=64)
    s.add_argument(
        "--exp-avg-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="dense Adam; bf16 = Megatron's --use-precision-aware-optimizer (TE FusedAdam, "
        "which also keeps the masters as remainders)",
    )
    s.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16"], default="fp32", help="Adam")
    s.add_argument("--no-reference-model", action="store_true")
    s.add_argument(
        "--kl-coef", type=_number(allow_zero=True), default=None, help="0: no reference model"
    )
    s.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    s.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="full recompute (default uniform)",
    )
    s.add_argument("--recompute-num-layers", type=pos, default=None, help="default 1")
    s.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Megatron's alias of --recompute-granularity selective",
    )
    s.add_argument(
        "--rollout-batch-size",
        type=nonneg,
        default=None,
        help="sequences generated per model replica and RL step; default: --prompts-per-step "
        "x --num-generations / DP, else --micro-batch-size; 0: rollouts generated elsewhere",
    )
    s.add_argument("--prompts-per-step", type=pos, default=None, help="over all DP ranks")
    s.add_argument("--num-generations", type=pos, default=4)
    s.add_argument("--rollout-engine", choices=engine_choices(), default="auto")
    s.add_argument(
        "--inference-max-tokens",
        type=pos,
        default=None,
        help="rollout KV budget in tokens: min(rows x seq-length, this)",
    )
    s.add_argument("--log-prob-micro-batch-size", type=pos, default=None, help="reference forward")
    s.add_argument(
        "--kl-probe-sequences",
        type=nonneg,
        default=None,
        help="sequences of each predicted-KL trial forward per step and replica: the probe "
        "and, with --kl-realized-interval, the held-out set (0: off); default: from "
        "--kl-target, --kl-probe-fraction and --kl-realized-interval",
    )
    s.add_argument("--kl-target", type=_float, default=None, help="turns the KL probe on")
    s.add_argument("--kl-probe-fraction", type=_float, default=0.125)
    s.add_argument(
        "--kl-realized-interval", type=nonneg, default=1,
        help="kl/realized every N steps (0: never): its held-out rows join the trial forward",
    )  # fmt: skip
    s.add_argument("--kl-estimator", choices=["full", "k1", "k2", "k3"], default="full")
    r = p.add_argument_group("runtime (the launch environment)")
    r.add_argument("--gpu-memory-gb", type=_float, default=80.0, help="GiB per GPU")
    r.add_argument(
        "--runtime-overhead-gb",
        type=float,
        default=2.0,
        help="CUDA/cuBLAS/TE workspaces and the like (NCCL is counted apart)",
    )
    r.add_argument("--gpus-per-node", type=pos, default=8, help="where communicators stay")
    r.add_argument(
        "--nccl-nvls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="NCCL's NVLink SHARP buffers (NCCL's default on NVSwitch nodes; "
        "--no-nccl-nvls = NCCL_NVLS_ENABLE=0)",
    )
    r.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (without it a freed KV "
        "buffer's segment may stay pinned: counted once more in the rollout)",
    )
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return p


def _flag(field: str, args: argparse.Namespace) -> str:
    if args.hf_config and field in {f.name for f in dataclasses.fields(TransformerShape)}:
        return "--hf-config"
    return "--" + field.replace("_", "-")


def _model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TransformerShape:
    manual = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    flags = {
        "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights,
        "swiglu": args.swiglu,
        "add_qkv_bias": args.add_qkv_bias,
        "qk_layernorm": args.qk_layernorm,
    }
    flags = {k: v for k, v in flags.items() if v is not None}
    if args.hf_config:
        given = [*manual, *flags]
        if given:
            parser.error(f"argument --{given[0].replace('_', '-')}: not allowed with --hf-config")
        if not os.path.exists(args.hf_config):
            parser.error(f"argument --hf-config: no such file: {args.hf_config}")

        from loggra_megatron.convert.hf_config import gpt_args_from_hf  # imports torch

        try:
            hf = gpt_args_from_hf(args.hf_config)
        except (ValueError, OSError, TypeError) as e:
            parser.error(f"argument --hf-config: {e}")
        shape = TransformerShape.from_model_args(hf)
        return dataclasses.replace(
            shape, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by
        )
    required = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
    for name in (*required, "vocab_size"):
        if name not in manual:
            parser.error(f"argument --{name.replace('_', '-')} is required without --hf-config")
    return TransformerShape(
        **manual, **flags, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by
    )


def _configs(args, parser) -> tuple[TransformerShape, ParallelConfig, RLStepConfig]:
    model = _model(args, parser)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = args.data_parallel_size or 1
    if args.world_size is not None:
        if args.world_size % (tp * pp):
            parser.error(
                f"argument --world-size: {args.world_size} is not divisible by TP·PP = {tp}·{pp}"
            )
        dp = args.world_size // (tp * pp)
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        sequence_parallel=args.sequence_parallel,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        gpus_per_node=args.gpus_per_node,
    )
    parallel.check(model)
    return model, parallel, _step(args, parser, dp)


def _per_replica(args, parser, flag: str, total: int, dp: int) -> int:
    if total % dp:
        parser.error(f"argument {flag}: {total} is not divisible by the DP size {dp}")
    return total // dp


def _step(args, parser, dp: int) -> RLStepConfig:
    """The RL step of pretrain_rl.py's flags (the same names and defaults where they exist)."""
    err = parser.error
    if args.recompute_granularity != "full" and (
        args.recompute_method or args.recompute_num_layers
    ):
        err("argument --recompute-method: applies to --recompute-granularity full only")
    recompute = args.recompute_granularity or (
        "selective" if args.recompute_activations else "none"
    )
    if args.fp8_format and args.transformer_impl == "local":
        err("argument --fp8-format: FP8 needs --transformer-impl transformer_engine (or auto)")
    if args.fp8_format and not args.bf16:
        err("argument --fp8-format: FP8 training needs --bf16")
    precision = "fp8" if args.fp8_format else "bf16" if args.bf16 else "fp32"
    # auto as pretrain_rl.py on a GPU, by the precision (flash-attn takes fp16/bf16 only)
    on_gpu = EngineTarget(cuda=True, half=precision != "fp32")
    engine, _ = select_engine(args.rollout_engine, on_gpu, planning=True)
    recipe = args.fp8_recipe if args.fp8_format else None
    reason = engine.refusal(EngineTarget(cuda=True, half=True, fp8_recipe=recipe))
    if reason is not None:
        err(f"argument --fp8-recipe: {reason} (as pretrain_rl.py), or another --rollout-engine")
    if args.runtime_overhead_gb < 0:
        err("argument --runtime-overhead-gb: must be >= 0")
    if args.kl_coef and args.no_reference_model:
        err("argument --kl-coef: > 0 needs the reference model (drop --no-reference-model)")
    reference = not args.no_reference_model and args.kl_coef != 0
    rollout = args.micro_batch_size if args.rollout_batch_size is None else args.rollout_batch_size
    if args.prompts_per_step is not None:
        if args.rollout_batch_size is not None:
            err("argument --rollout-batch-size: not allowed with --prompts-per-step")
        total = args.prompts_per_step * args.num_generations
        rollout = _per_replica(args, parser, "--prompts-per-step", total, dp)
    step_seqs = rollout  # sequences per optimizer step and replica
    num_micro = args.num_microbatches
    if args.global_batch_size is not None:
        if args.prompts_per_step is not None and total % args.global_batch_size:
            err(f"argument --global-batch-size: must divide the rollout batch {total}")
        step_seqs = _per_replica(args, parser, "--global-batch-size", args.global_batch_size, dp)
        if step_seqs % args.micro_batch_size:
            err("argument --global-batch-size: not a multiple of --micro-batch-size x DP")
        num_micro = num_micro or step_seqs // args.micro_batch_size
    probe = args.kl_probe_sequences
    if probe is None:  # the controller's own split: probe rows, then the held-out rows
        probe = 0
        if args.kl_target is not None:
            if not step_seqs:
                err("argument --kl-target: give --global-batch-size (the probe is a fraction)")
            from loggra_megatron.rl.config import KLControlConfig  # imports torch

            try:
                kl = KLControlConfig(kl_target=args.kl_target,
                                     kl_probe_fraction=args.kl_probe_fraction,
                                     kl_realized_interval=args.kl_realized_interval)  # fmt: skip
            except ValueError as e:
                err(str(e))
            rows, holdout = kl.probe_split(step_seqs)
            probe = holdout.stop if kl.kl_realized_interval else rows.stop
    return RLStepConfig(
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        precision=precision,
        main_grads_dtype="bf16" if args.grad_reduce_in_bf16 else args.main_grads_dtype,
        optimizer=args.optimizer,
        loggra_rank=args.loggra_rank,
        loggra_min_dim=args.loggra_min_dim,
        exp_avg_dtype=args.exp_avg_dtype,
        exp_avg_sq_dtype=args.exp_avg_sq_dtype,
        loggra_fp32_grad_copy=args.loggra_fp32_grad_copy,
        loggra_param_remainders=args.loggra_param_remainders,
        distributed_optimizer=args.use_distributed_optimizer,
        reference_model=reference,
        recompute_granularity=recompute,
        recompute_method=args.recompute_method or "uniform",
        recompute_num_layers=args.recompute_num_layers or 1,
        rollout_batch_size=rollout,
        inference_max_tokens=args.inference_max_tokens,
        rollout_engine=engine.name,
        max_new_tokens=args.max_new_tokens,
        log_prob_micro_batch_size=args.log_prob_micro_batch_size,
        num_microbatches=num_micro,
        kl_probe_sequences=probe,
        kl_estimator=args.kl_estimator,
        runtime_overhead_bytes=int(args.runtime_overhead_gb * GiB),
        nccl_nvls=args.nccl_nvls,
        expandable_segments=args.expandable_segments,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model, parallel, step = _configs(args, parser)
        names = dict.fromkeys(("adam", "loggra", step.optimizer))  # and the run's own
        steps = {opt: dataclasses.replace(step, optimizer=opt) for opt in names}
        results = {opt: estimate_rl_step_memory(model, parallel, s) for opt, s in steps.items()}
    except MemoryConfigError as e:
        parser.error(f"argument {_flag(e.field, args)}: {e.message}")
    gpu_bytes = int(args.gpu_memory_gb * GiB)
    if args.json:
        out = {
            opt: {
                **{k: v / GiB for k, v in b.terms().items()},
                "total": b.total_bytes / GiB,
                "peak_phase": b.peak_phase,
                "phases": {k: v / GiB for k, v in b.phases().items()},
                "fits": b.fits(gpu_bytes),
                "stage": b.stage,
            }
            for opt, b in results.items()
        }
        print(json.dumps({"unit": "GiB", **out}, indent=2))
        return 0
    print(
        report(
            model, parallel, steps, results, gpu_bytes, args.hf_config or "flags", step.optimizer
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
