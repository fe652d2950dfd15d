"""Generation on ranks of its own against the colocated loop, on the tiny CPU example:
colocated (2 ranks, DP = 2), lock-step generation ranks (2 training ranks + 1 generation rank,
``--generation-ranks 1``), one step ahead (``--max-policy-lag 1``), and one step ahead with
the low-rank weight sync (``--weight-sync lowrank``), over seeds, side by side in one
invocation.

    python benchmarks/placement_rl.py --out runs/placement            # runs + table
    python benchmarks/placement_rl.py --out runs/placement --summarize

Every arm loads the same supervised warm-up (``benchmarks/reward_parity.py``'s, made once
under ``--out`` and reused) and runs the tiny example's GRPO job
(``examples/tiny_cpu/run.sh``: LoGRA as published, predicted-KL control, bf16) with
``--tis-cap 2`` in every arm (the one-step-ahead arm needs its importance weights, and the
others then optimise the same objective). The table gives, per arm over seeds (mean ± std):
the final reward and accuracy (means of the last 10 steps), the median step time and its
ratio to the colocated arm's, the trainer's idle share of a step
(``time/training_idle_s / time/step_s``), the share of generation time hidden behind
training, the bytes of the weight sync per step and the policy lag (mean, max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from reward_parity import BACKWARD, COMMON, run_dir, warm_up
from tiny_example import with_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_KL = ["--kl-target", "0.02"]
"""The tiny example's predicted-KL control (``examples/tiny_cpu/run.sh``)."""
ARMS = {
    "colocated": (2, []),
    "generation ranks, lock-step": (3, ["--generation-ranks", "1"]),
    "generation ranks, one step ahead": (3, ["--generation-ranks", "1", "--max-policy-lag", "1"]),
    "generation ranks, one step ahead, low-rank sync": (
        3,
        ["--generation-ranks", "1", "--max-policy-lag", "1", "--weight-sync", "lowrank"],
    ),
}
"""Each arm's processes and flags."""


def launch(nproc: int, out: str) -> list[str]:
    tokenizer = os.path.join(out, "tokenizer.model")
    if not os.path.exists(tokenizer):
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py")]
            + ["--builtin-tasks", "20000", "--vocab-size", "256"]
            + ["--output-prefix", os.path.join(out, "tokenizer")],
            check=True,
        )
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", str(nproc), os.path.join(ROOT, "pretrain_rl.py")),
        *with_flags(COMMON, tokenizer_model=tokenizer),
    ]


def run(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    warmup = warm_up(launch(2, args.out), args.out)
    for seed in args.seeds:
        for name, (nproc, flags) in ARMS.items():
            out = run_dir(args.out, name, seed)
            if os.path.exists(os.path.join(out, "metrics.jsonl")):
                continue
            print(f"== {name}, seed {seed}", flush=True)
            subprocess.run(
                [*launch(nproc, args.out), *BACKWARD, *EXAMPLE_KL, "--tis-cap", "2", *flags]
                + ["--load", warmup, "--no-load-optim", "--seed", str(seed)]
                + ["--train-iters", str(args.train_iters), "--output-dir", out],
                check=True,
                stdout=subprocess.DEVNULL,
            )


def _arm_columns(rows: list[dict]) -> dict[str, float]:
    last = rows[-10:]
    return {
        "final": statistics.mean(r["reward/mean"] for r in last),
        "acc": statistics.mean(r["reward/accuracy"] for r in last),
        "step": statistics.median(r["time/step_s"] for r in rows[1:]),
        "idle": statistics.mean(r.get("time/training_idle_s", 0) / r["time/step_s"] for r in rows),
        "hidden": statistics.mean(r.get("time/generation_hidden_fraction", 0) for r in rows),
        "bytes": statistics.mean(r.get("sync/bytes", 0) for r in rows),
        "lag": statistics.mean(r.get("rollout/policy_lag", 0) for r in rows),
        "lag_max": max(r.get("rollout/policy_lag", 0) for r in rows),
    }


def summarize(args) -> None:
    from loggra_megatron.metrics import read_metrics

    def fmt(values, digits=3):
        return f"{statistics.mean(values):.{digits}f} ± {statistics.pstdev(values):.{digits}f}"

    print(
        "\n| arm | final reward | final accuracy | step time (s) | vs colocated | trainer idle "
        "| generation hidden | sync bytes / step | lag mean, max |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for name in ARMS:
        if not os.path.exists(
            os.path.join(run_dir(args.out, name, args.seeds[0]), "metrics.jsonl")
        ):
            continue
        cols = [_arm_columns(read_metrics(run_dir(args.out, name, s))) for s in args.seeds]
        col = {k: [c[k] for c in cols] for k in cols[0]}
        step = statistics.mean(col["step"])
        base = base or step
        print(
            f"| {name} | {fmt(col['final'])} | {fmt(col['acc'])} | {fmt(col['step'], 2)} "
            f"| {step / base:.2f}× | {100 * statistics.mean(col['idle']):.0f} % "
            f"| {100 * statistics.mean(col['hidden']):.0f} % | {statistics.mean(col['bytes']):,.0f} "
            f"| {statistics.mean(col['lag']):.2f}, {max(col['lag_max']):.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/placement")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--train-iters", type=int, default=60)
    ap.add_argument("--summarize", action="store_true", help="only print the table")
    args = ap.parse_args()
    if not args.summarize:
        run(args)
    summarize(args)


if __name__ == "__main__":
    main()
