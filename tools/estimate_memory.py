# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Per-GPU memory of one RL step with dense Adam and with LoGRA, side by side.

The model is :mod:`loggra_megatron.memory.model` (its docstring states every formula and
assumption). Give the architecture as a Hugging Face ``config.json`` (Llama / Qwen2 / Qwen3;
small ones ship in ``tools/configs/``) or with Megatron-LM's flags::

    python tools/estimate_memory.py --hf-config tools/configs/llama-style-27b.json \\
        --tensor-model-parallel-size 8 --sequence-parallel --world-size 8 \\
        --micro-batch-size 1 --seq-length 8192 --bf16 --loggra-rank 128 \\
        --rollout-batch-size 64 --gpu-memory-gb 80

    python tools/estimate_memory.py --num-layers 32 --hidden-size 4096 \\
        --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8 \\
        --vocab-size 128256 --untie-embeddings-and-output-weights --world-size 8 ...

Sizes are GiB (2^30 bytes); ``--gpu-memory-gb 80`` means the 80 GiB of an A100/H100 80GB
(PyTorch can allocate about 79.1 GiB of it). Invalid input exits with status 2 and a message
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
    MemoryBreakdown,
    MemoryConfigError,
    ParallelConfig,
    RLStepConfig,
    TransformerShape,
    estimate_rl_step_memory,
    max_rollout_batch_size,
    num_parameters,
)
from loggra_megatron.optim.registry import OPTIMIZERS

_SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
)
_LABELS = {
    "weights": "weights",
    "fp8_weight_cache": "fp8 weight cache (TE)",
    "grads": "grads",
    "master_params": "master params (fp32)",
    "optimizer_state": "optimizer state",
    "reference_model": "reference model",
    "runtime_overhead": "runtime overhead",
    "kv_cache": "rollout: KV cache",
    "rollout_logits": "rollout: logits",
    "activations": "training: activations",
    "logits": "training: logits",
    "kl_probe_logits": "kl control: probe logits",
    "main_grad_copies": "optimizer: fp32 grad copies",
}


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


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


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

    s = p.add_argument_group("step")
    s.add_argument("--micro-batch-size", type=pos, default=1)
    s.add_argument("--seq-length", type=pos, default=4096, help="prompt + response tokens")
    s.add_argument("--num-microbatches", type=pos, default=None, help="default: >= PP")
    prec = s.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="bf16 params (default)")
    prec.add_argument(
        "--fp8-format", choices=["hybrid", "e4m3"], default=None, help="FP8 GEMMs (TE, Hopper)"
    )
    s.add_argument("--main-grads-dtype", choices=["fp32", "bf16"], default="fp32")
    s.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="loggra",
        help="the optimizer the run uses (marked *); both are always shown",
    )
    s.add_argument("--loggra-rank", type=pos, default=128)
    s.add_argument("--loggra-min-dim", type=pos, default=64)
    s.add_argument("--exp-avg-dtype", choices=["fp32", "bf16"], default="fp32", help="Adam")
    s.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16"], default="fp32", help="Adam")
    s.add_argument("--no-reference-model", action="store_true")
    s.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="full: store layer inputs only (with --recompute-method uniform "
        "--recompute-num-layers 1)",
    )
    s.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Megatron's alias of --recompute-granularity selective",
    )
    s.add_argument(
        "--rollout-batch-size",
        type=nonneg,
        default=None,
        help="sequences generated concurrently per model replica (KV cache); "
        "default: --micro-batch-size; 0: rollouts generated elsewhere",
    )
    s.add_argument(
        "--kl-probe-sequences",
        type=nonneg,
        default=0,
        help="predicted-KL control's probe sequences per step and replica (0: off)",
    )
    s.add_argument("--kl-estimator", choices=["full", "k1", "k2", "k3"], default="full")
    s.add_argument("--gpu-memory-gb", type=_float, default=80.0, help="GiB per GPU")
    s.add_argument(
        "--runtime-overhead-gb", type=float, default=2.0, help="CUDA context, NCCL, workspaces"
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
    )
    parallel.check(model)
    recompute = args.recompute_granularity or (
        "selective" if args.recompute_activations else "none"
    )
    if args.runtime_overhead_gb < 0:
        parser.error("argument --runtime-overhead-gb: must be >= 0")
    step = RLStepConfig(
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        precision="fp8" if args.fp8_format else "bf16",
        main_grads_dtype=args.main_grads_dtype,
        optimizer=args.optimizer,
        loggra_rank=args.loggra_rank,
        loggra_min_dim=args.loggra_min_dim,
        exp_avg_dtype=args.exp_avg_dtype,
        exp_avg_sq_dtype=args.exp_avg_sq_dtype,
        reference_model=not args.no_reference_model,
        recompute_granularity=recompute,
        rollout_batch_size=(
            args.micro_batch_size if args.rollout_batch_size is None else args.rollout_batch_size
        ),
        num_microbatches=args.num_microbatches,
        kl_probe_sequences=args.kl_probe_sequences,
        kl_estimator=args.kl_estimator,
        runtime_overhead_bytes=int(args.runtime_overhead_gb * GiB),
    )
    return model, parallel, step


def _gib(x: int) -> str:
    return f"{x / GiB:.2f}"


def _report(model, parallel, steps, results, gpu_bytes, source, selected) -> str:
    dense, loggra = results["adam"], results["loggra"]
    step = steps["loggra"]
    t, p, d = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.data_parallel_size,
    )
    pdt = "fp32" if step.precision == "fp32" else "bf16"
    lines = [
        f"model     {source}: {num_parameters(model) / 1e9:.2f} B params, {model.num_layers} "
        f"layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size}"
        f"{' (SwiGLU)' if model.swiglu else ''}, {model.num_attention_heads} heads / "
        f"{model.num_query_groups} KV groups x {model.kv_channels}, vocab {model.vocab_size} "
        f"(padded {model.padded_vocab_size(t)}), "
        f"{'untied' if model.untie_embeddings_and_output_weights else 'tied'} embeddings",
        f"parallel  TP {t} x PP {p} x DP {d} = {parallel.world_size} GPUs"
        f"{', sequence parallel' if parallel.sequence_parallel else ''}; distributed optimizer "
        f"(ZeRO-1); stage {dense.stage} of {p} is the most loaded "
        f"({dense.num_parameters / 1e9:.3f} B params/GPU)"
        + (" ; virtual stages ignored" if parallel.virtual_pipeline_model_parallel_size else ""),
        f"step      {step.precision}, {'fp32' if step.grad_bytes == 4 else 'bf16'} grads, micro-batch "
        f"{step.micro_batch_size} x {step.seq_length} tokens, recompute "
        f"{step.recompute_granularity}, reference model "
        f"{'on' if step.reference_model else 'off'}, rollout batch {step.rollout_batch_size}"
        + (
            f", KL probe {step.kl_probe_sequences} seqs ({step.kl_estimator})"
            if step.kl_probe_sequences
            else ""
        ),
        "",
    ]
    mark = {k: "*" if selected == k else " " for k in ("adam", "loggra")}
    header = f"{'GiB per GPU':<28}{'dense Adam' + mark['adam']:>20}"
    header += f"{f'LoGRA r={step.loggra_rank}' + mark['loggra']:>20}{'LoGRA - Adam':>14}"
    lines += [header, "-" * len(header)]
    gdt = "fp32" if step.grad_bytes == 4 else "bf16"
    suffix = {"weights": f" ({pdt})", "grads": f" ({gdt})"}
    suffix["reference_model"] = f" ({pdt})"
    suffix["optimizer_state"] = " (/DP)" if d > 1 else ""
    suffix["master_params"] = " (/DP)" if d > 1 else ""

    def row(label, a, b):
        diff = f"{(b - a) / GiB:+.2f}" if a != b else ""
        return f"{label:<28}{_gib(a):>20}{_gib(b):>20}{diff:>14}".rstrip()

    dt, lt = dense.terms(), loggra.terms()
    for key in MemoryBreakdown.STATIC:
        if dt[key] or lt[key]:
            lines.append(row(_LABELS[key] + suffix.get(key, ""), dt[key], lt[key]))
    lines.append(row("  static", dense.static_bytes, loggra.static_bytes))
    for key in MemoryBreakdown.TRANSIENT:
        if dt[key] or lt[key]:
            lines.append(row(_LABELS[key], dt[key], lt[key]))
    lines.append(f"{'peak phase':<28}{dense.peak_phase:>20}{loggra.peak_phase:>20}")
    lines.append("-" * len(header))
    saved = 100.0 * (dense.total_bytes - loggra.total_bytes) / dense.total_bytes
    lines.append(
        row("TOTAL per GPU", dense.total_bytes, loggra.total_bytes) + f"  ({saved:.1f}% saved)"
    )

    def verdict(b: MemoryBreakdown) -> str:
        left = (gpu_bytes - b.total_bytes) / GiB
        return f"yes ({left:.2f} free)" if left >= 0 else f"NO (over by {-left:.2f})"

    gb = gpu_bytes / GiB
    lines.append(f"{f'fits {gb:g} GiB':<28}{verdict(dense):>20}{verdict(loggra):>20}")
    cap = {k: max_rollout_batch_size(model, parallel, steps[k], gpu_bytes) for k in mark}
    cap_s = {k: "none" if v is None else str(v) for k, v in cap.items()}
    lines.append(f"{'max rollout batch that fits':<28}{cap_s['adam']:>20}{cap_s['loggra']:>20}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model, parallel, step = _configs(args, parser)
        steps = {opt: dataclasses.replace(step, optimizer=opt) for opt in ("adam", "loggra")}
        results = {opt: estimate_rl_step_memory(model, parallel, s) for opt, s in steps.items()}
    except MemoryConfigError as e:
        parser.error(f"argument {_flag(e.field, args)}: {e.message}")
    gpu_bytes = int(args.gpu_memory_gb * GiB)
    if args.json:
        out = {
            opt: {
                **{k: v / GiB for k, v in b.terms().items()},
                "total": b.total_bytes / GiB,
                "fits": b.fits(gpu_bytes),
                "stage": b.stage,
            }
            for opt, b in results.items()
        }
        print(json.dumps({"unit": "GiB", **out}, indent=2))
        return 0
    print(
        _report(
            model, parallel, steps, results, gpu_bytes, args.hf_config or "flags", step.optimizer
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
