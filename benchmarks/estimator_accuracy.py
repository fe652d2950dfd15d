"""The memory estimator against a measured RL step, phase by phase, on the same shape.

    python benchmarks/estimator_accuracy.py                       # the default CPU shape
    python benchmarks/estimator_accuracy.py --reference-offload
    torchrun --nproc-per-node 2 benchmarks/estimator_accuracy.py  # DP = 2 (rank 0 prints)

Each setting of ``benchmarks/memory_rl.py`` (dense Adam, LoGRA's gradient and backward
sketches; fp32 or bf16 grads; fp32 masters or remainders) is measured there (persistent
tensors plus each phase's allocator peak on CPU) and estimated by ``tools/estimate_memory.py
--json`` with the flags of the same step: the model, ``--micro-batch-size 1``,
``--log-prob-micro-batch-size 1``, the static engine, ``--loggra-rank hidden/8``, the
reference on (``--kl-coef``) and offloaded as asked, and ``--adam-implementation single``
(Megatron's dense Adam is ``torch.optim.AdamW`` on CPU, without TE or apex). Compared per phase is the peak of the
phase: persistent + its transient measured, static + its transient estimated, where

* the step's phases are ``rollout``, ``log_probs`` (the reference's) and ``training``
  (forward, backward and optimizer step: the estimator's ``training`` and ``optimizer step``,
  the larger);
* the estimator's GPU-only terms are left out: NCCL's and NVLS buffers, the runtime
  workspaces (``--runtime-overhead-gb 0``) and the allocator's fragmentation
  (``--expandable-segments``), none of which a CPU step has.

Prints a table of measured and estimated GiB and their ratio (``static``: the persistent
tensors against the static terms); the goal is ±5 % at each phase's peak (docs/memory.md,
"Accuracy against a measured step").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import memory_rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_ONLY = ("nccl_buffers", "nvls_buffers", "runtime_overhead")
"""Static estimator terms a CPU step does not have (the rollout's allocator fragmentation is
0 with ``--expandable-segments``)."""
GIB = 2**30
PHASES = {"rollout": ("rollout",), "log_probs": ("ref log-probs",)}
PHASES["training"] = ("training", "optimizer step")


def estimator_flags(args, kind: str, bf16_grads: bool, remainders: bool, dp: int) -> list[str]:
    """``tools/estimate_memory.py`` flags of ``memory_rl.py``'s step with this setting."""
    rows = args.rollout_rows * dp
    flags = [
        *("--num-layers", args.layers, "--hidden-size", args.hidden),
        *("--ffn-hidden-size", args.ffn, "--num-attention-heads", args.heads),
        *("--vocab-size", args.vocab, "--make-vocab-size-divisible-by", 1),
        *("--seq-length", args.seq, "--max-new-tokens", args.new_tokens),
        *("--untie-embeddings-and-output-weights", "--bf16", "--transformer-impl", "local"),
        *("--micro-batch-size", 1, "--log-prob-micro-batch-size", 1),
        *("--global-batch-size", rows, "--num-generations", args.num_generations),
        *("--prompts-per-step", rows // args.num_generations),
        *("--rollout-engine", "static", "--world-size", dp, "--gpu-memory-gb", 80),
        *("--runtime-overhead-gb", 0, "--expandable-segments", "--no-nccl-nvls", "--json"),
        *("--adam-implementation", "single", "--device", "cpu"),
    ]
    if args.log_prob_chunk_size:
        flags += ["--log-prob-chunk-size", args.log_prob_chunk_size]
    if args.with_reference:
        flags += ["--kl-coef", 0.01] + (["--reference-offload"] if args.reference_offload else [])
    if kind == "dense":
        flags += ["--optimizer", "adam"]
    else:
        flags += ["--optimizer", "loggra", "--loggra-rank", args.hidden // 8]
        flags += ["--loggra-sketch", "backward" if kind == "backward" else "gradient"]
        flags += ["--loggra-param-remainders"] if remainders else []
        if kind == "backward" and dp > 1:
            flags += ["--loggra-sketch-reduce", args.loggra_sketch_reduce]
    return [str(f) for f in flags + (["--grad-reduce-in-bf16"] if bf16_grads else [])]


def estimate(flags: list[str], column: str) -> dict[str, float]:
    """Estimated bytes of the static terms and at each of the step's phases' peaks (GPU-only
    terms left out)."""
    tool = os.path.join(ROOT, "tools", "estimate_memory.py")
    out = subprocess.run(
        [sys.executable, tool, *flags], capture_output=True, text=True, check=True
    ).stdout
    result = json.loads(out)[column]  # GiB
    assert result["allocator_fragmentation"] == 0  # --expandable-segments
    phases = result["phases"]
    static = result["total"] - max(phases.values()) - sum(result[k] for k in GPU_ONLY)
    peaks = {name: (static + max(phases[p] for p in keys)) * GIB for name, keys in PHASES.items()}
    return {"static": static * GIB, **peaks}


def parse_args(argv=None) -> argparse.Namespace:
    args = memory_rl.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("--device: the comparison is on CPU (a GPU step: memory_rl.py)")
    args.with_reference = args.reference != "no"
    return args


def main(argv=None) -> None:
    import torch.distributed as dist

    from loggra_megatron.parallel import initialize_megatron

    args = parse_args(argv)
    initialize_megatron(device="cpu")
    dp = dist.get_world_size()
    rows = compare(args, dp, memory_rl.SETTINGS)
    if dist.get_rank() == 0:
        print(report(args, dp, rows))
    dist.destroy_process_group()


def compare(args, dp: int, settings: dict) -> list[tuple[str, str, str, int, float]]:
    """``(optimizer, setting, phase, measured, estimated)`` bytes of each setting of
    ``settings`` (``memory_rl.SETTINGS``' form), ``static`` first (the persistent tensors)."""
    rows = []
    for kind, legal in settings.items():
        for bf16_grads, remainders in legal:
            measured = memory_rl.measure(kind, args, bf16_grads, args.with_reference, remainders)
            flags = estimator_flags(args, kind, bf16_grads, remainders, dp)
            estimated = estimate(flags, "adam" if kind == "dense" else "loggra")
            name = memory_rl.setting_name(kind, bf16_grads, remainders)
            rows.append((kind, name, "static", measured["persistent"], estimated["static"]))
            for phase in PHASES:
                got = measured["persistent"] + measured[phase]
                rows.append((kind, name, phase, got, estimated[phase]))
    return rows


def report(args, dp: int, rows) -> str:
    lines = [
        f"# estimator_accuracy: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
        f"{args.rollout_rows} x {args.seq} tokens, DP={dp}, reference "
        f"{'offloaded' if args.reference_offload else 'resident' if args.with_reference else 'off'}"
        f", CPU; GiB at each phase's peak",
        "",
        "| optimizer | setting | phase | measured | estimated | estimated / measured |",
        "|---|---|---|---:|---:|---:|",
    ]
    for kind, name, phase, got, est in rows:
        lines.append(
            f"| {kind} | {name} | {phase} | {got / GIB:.4f} | {est / GIB:.4f} | {est / got:.3f} |"
        )
    worst = max(abs(est / got - 1) for _, _, phase, got, est in rows if phase != "static")
    lines.append(f"\nlargest error at a phase's peak: {100 * worst:.1f} % (goal: within 5 %)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
