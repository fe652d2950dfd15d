"""Reward parity: dense Adam vs LoGRA vs LoGRA + predicted-KL control, several seeds.

    python benchmarks/reward_parity.py --out runs/parity            # runs + table
    python benchmarks/reward_parity.py --out runs/parity --summarize  # table only

One shared supervised warm-up (200 steps, LoGRA) is saved first; every run then loads
those weights (``--no-load-optim``) and runs the tiny CPU example's GRPO job (2 processes,
DP=2, bf16, 1-digit arithmetic) with only the optimizer settings changed. The table
reports, per configuration over seeds (mean ± std): final reward (mean of the last 10
steps), area under the reward curve (mean over all steps), final exact-match accuracy,
KL to the reference (mean of the last 10 steps) and throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "dense Adam": ["--optimizer", "adam"],
    "LoGRA": ["--optimizer", "loggra", "--loggra-rank", "16"],
    "LoGRA + KL control": ["--optimizer", "loggra", "--loggra-rank", "16", "--kl-target", "0.005"],
}
COMMON = [
    "--task", "arithmetic", "--num-tasks", "20000", "--task-digits", "1", "--task-operators", "+-",
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
    "--bf16", "--prompts-per-step", "16",
    "--num-generations", "8", "--max-new-tokens", "16", "--global-batch-size", "64",
    "--micro-batch-size", "32", "--lr", "1e-4", "--lr-warmup-iters", "5", "--loggra-min-dim", "32",
    "--kl-coef", "0.01",
]  # fmt: skip


def run_dir(out: str, name: str, seed: int) -> str:
    return os.path.join(out, name.replace(" ", "_").replace("+", "plus"), f"seed{seed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/parity")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--train-iters", type=int, default=60)
    ap.add_argument("--summarize", action="store_true", help="only print the table")
    args = ap.parse_args()
    tokenizer = os.path.join(args.out, "tokenizer")
    if not args.summarize:
        os.makedirs(args.out, exist_ok=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"),
                        "--builtin-tasks", "20000", "--vocab-size", "256",
                        "--output-prefix", tokenizer], check=True)  # fmt: skip
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", os.path.join(ROOT, "pretrain_rl.py"), *COMMON,
                  "--tokenizer-model", f"{tokenizer}.model"]  # fmt: skip
        warmup = os.path.join(args.out, "warmup")
        print("== supervised warm-up", flush=True)
        subprocess.run([*launch, *CONFIGS["LoGRA"], "--sft-iters", "200", "--sft-lr", "3e-3",
                        "--train-iters", "0", "--save", warmup], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        for name, flags in CONFIGS.items():
            for seed in args.seeds:
                print(f"== {name}, seed {seed}", flush=True)
                subprocess.run([*launch, *flags, "--load", warmup, "--no-load-optim",
                                "--seed", str(seed), "--train-iters", str(args.train_iters),
                                "--output-dir", run_dir(args.out, name, seed)],
                               check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    summarize(args)


def summarize(args) -> None:
    from loggra_megatron.metrics import read_metrics

    def fmt(values):
        return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"

    print("\n| configuration | final reward | reward AUC | final accuracy | KL to ref | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    finals = {}
    for name in CONFIGS:
        cols = {k: [] for k in ("final", "auc", "acc", "kl", "tps")}
        for seed in args.seeds:
            rows = read_metrics(run_dir(args.out, name, seed))
            last = rows[-10:]
            cols["final"].append(statistics.mean(r["reward/mean"] for r in last))
            cols["auc"].append(statistics.mean(r["reward/mean"] for r in rows))
            cols["acc"].append(statistics.mean(r["reward/accuracy"] for r in last))
            cols["kl"].append(statistics.mean(r["kl/ref"] for r in last))
            cols["tps"].append(statistics.mean(r["throughput/tokens_per_s"] for r in rows))
        finals[name] = statistics.mean(cols["final"])
        print(f"| {name} | {fmt(cols['final'])} | {fmt(cols['auc'])} | {fmt(cols['acc'])} "
              f"| {fmt(cols['kl'])} | {statistics.mean(cols['tps']):.0f} |")  # fmt: skip
    base = finals["dense Adam"]
    for name, value in finals.items():
        print(f"{name}: final reward {100 * (value - base) / base:+.1f} % vs dense Adam")


if __name__ == "__main__":
    main()
