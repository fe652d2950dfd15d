"""Reward parity and stability: dense Adam, LoGRA (the backward sketch as published, the
default, and the gradient sketch), LoGRA + predicted-KL control and the GaLore-style ``svd``
projection over several seeds, and a 10x-learning-rate stress test.

    python benchmarks/reward_parity.py --out runs/parity            # runs + table
    python benchmarks/reward_parity.py --out runs/parity --summarize  # table only
    python benchmarks/reward_parity.py --out runs/parity --configs LoGRA  # a subset

One shared supervised warm-up (200 steps, its own dense Adam: ``--sft-optimizer``'s
default) is saved first (and reused if present);
every run then loads those weights (``--no-load-optim``) and runs the tiny CPU example's
GRPO job (2 processes, DP=2, bf16, 1-digit arithmetic) with only the optimizer settings
changed. ``--kl-target`` (default 1e-4) is chosen so that the controller binds on a
large share of the steps at lr 1e-4 (their predicted KL is ~1e-5 to 6e-4). The table
reports, per configuration over seeds (mean ± std): final reward (mean of the last 10
steps), area under the reward curve (mean over all steps), final exact-match accuracy,
KL to the reference (mean of the last 10 steps), the share of steps the controller
scaled down, and throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from tiny_example import example_flags, with_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGRA = [  # the gradient sketch
    *("--optimizer", "loggra", "--loggra-sketch", "gradient"),
    *("--loggra-rank", "16", "--loggra-min-dim", "32"),
]
BACKWARD = ["--optimizer", "loggra", "--loggra-rank", "16"]  # the default: as published
CONFIGS = {
    "dense Adam": ["--optimizer", "adam"],
    "LoGRA backward": BACKWARD,
    "LoGRA": LOGRA,
    "LoGRA backward, bf16 grads, remainders": [
        *BACKWARD,
        "--grad-reduce-in-bf16",
        "--loggra-param-remainders",
    ],
    "LoGRA + KL control": [*LOGRA, "--kl-target", "{kl_target}"],
    "GaLore-style svd": [*LOGRA, "--loggra-projection", "svd"],
    "LoGRA, bf16 grads": [*LOGRA, "--grad-reduce-in-bf16"],  # the 45 %-memory setting
    # + masters as bf16 weights and int16 remainders: the best-memory setting
    "LoGRA, bf16 grads, remainders": [*LOGRA, "--grad-reduce-in-bf16", "--loggra-param-remainders"],
    # stress: 10x the learning rate, with and without the controller
    "dense Adam, lr 1e-3": ["--optimizer", "adam", "--lr", "1e-3"],
    "LoGRA, lr 1e-3": [*LOGRA, "--lr", "1e-3"],
    "LoGRA + KL control, lr 1e-3": [*LOGRA, "--lr", "1e-3", "--kl-target", "{kl_target}"],
    "dense Adam + KL control, lr 1e-3": [
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--kl-target",
        "{kl_target}",
    ],
}
COMMON = with_flags(
    example_flags(),
    **dict.fromkeys(["tokenizer_model", "sft_iters", "sft_lr", "train_iters", "save_interval"]),
    **dict.fromkeys(["optimizer", "loggra_rank", "loggra_min_dim", "loggra_update_interval"]),
    **dict.fromkeys(["kl_target", "kl_ref_estimator"]),
)
"""``examples/tiny_cpu/run.sh``'s flags less the optimizer's, the KL settings (each arm sets
its own; the reference's estimator is the default k3), the warm-up, the steps and saving."""


def run_dir(out: str, name: str, seed: int) -> str:
    slug = name.replace(" ", "_").replace("+", "plus").replace(",", "")
    return os.path.join(out, slug, f"seed{seed}")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/parity")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--train-iters", type=int, default=60)
    ap.add_argument(
        "--kl-target",
        type=float,
        default=1e-4,
        help="target of the KL-control arm (chosen so that it binds on some steps)",
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        metavar="NAME",
        help="configurations to run (default: all)",
    )
    ap.add_argument("--summarize", action="store_true", help="only print the table")
    return ap.parse_args()


def launcher(out: str) -> list[str]:
    """Train the tokenizer into ``out``; the ``pretrain_rl.py`` command every run shares."""
    tokenizer = os.path.join(out, "tokenizer")
    os.makedirs(out, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "train_tokenizer.py"),
            "--builtin-tasks",
            "20000",
            "--vocab-size",
            "256",
            "--output-prefix",
            tokenizer,
        ],
        check=True,
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(ROOT, "pretrain_rl.py"),
        *COMMON,
        "--tokenizer-model",
        f"{tokenizer}.model",
    ]


def warm_up(launch: list[str], out: str) -> str:
    """The shared supervised warm-up (saved once, reused if present); returns its folder."""
    warmup = os.path.join(out, "warmup")
    if not os.path.exists(os.path.join(warmup, "latest_checkpointed_iteration.txt")):
        print("== supervised warm-up", flush=True)
        subprocess.run(
            [
                *launch,
                *BACKWARD,
                "--sft-iters",
                "200",
                "--sft-lr",
                "1e-3",  # the tiny example's, for its own dense Adam (--sft-optimizer)
                "--train-iters",
                "0",
                "--save",
                warmup,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return warmup


def run_configs(args, launch: list[str], warmup: str) -> None:
    """Every chosen configuration for every seed, from the warm-up's weights."""
    for name in args.configs:
        flags = [f.format(kl_target=args.kl_target) for f in CONFIGS[name]]
        for seed in args.seeds:
            print(f"== {name}, seed {seed}", flush=True)
            subprocess.run(
                [
                    *launch,
                    *flags,
                    "--load",
                    warmup,
                    "--no-load-optim",
                    "--seed",
                    str(seed),
                    "--train-iters",
                    str(args.train_iters),
                    "--output-dir",
                    run_dir(args.out, name, seed),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )


def main() -> None:
    args = parse_args()
    if not args.summarize:
        launch = launcher(args.out)
        run_configs(args, launch, warm_up(launch, args.out))
    summarize(args)


def summarize(args) -> None:
    from loggra_megatron.metrics import read_metrics

    def fmt(values):
        return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"

    print(
        "\n| configuration | final reward | reward AUC | final accuracy | KL to ref "
        "| steps scaled (η<1) | tokens/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    finals = {}
    for name in CONFIGS:
        if not os.path.exists(run_dir(args.out, name, args.seeds[0])):
            continue
        cols = {k: [] for k in ("final", "auc", "acc", "kl", "scaled", "tps")}
        for seed in args.seeds:
            rows = read_metrics(run_dir(args.out, name, seed))
            last = rows[-10:]
            cols["final"].append(statistics.mean(r["reward/mean"] for r in last))
            cols["auc"].append(statistics.mean(r["reward/mean"] for r in rows))
            cols["acc"].append(statistics.mean(r["reward/accuracy"] for r in last))
            cols["kl"].append(statistics.mean(r["kl/ref"] for r in last))
            scales = [r["kl/step_scale"] for r in rows if "kl/step_scale" in r]
            cols["scaled"].append(sum(x < 1 for x in scales) / len(rows))
            cols["tps"].append(statistics.mean(r["throughput/tokens_per_s"] for r in rows))
        finals[name] = statistics.mean(cols["final"])
        print(
            f"| {name} | {fmt(cols['final'])} | {fmt(cols['auc'])} | {fmt(cols['acc'])} "
            f"| {fmt(cols['kl'])} | {100 * statistics.mean(cols['scaled']):.0f} % "
            f"| {statistics.mean(cols['tps']):.0f} |"
        )
    base = finals.get("dense Adam")
    for name, value in finals.items() if base else ():
        print(f"{name}: final reward {100 * (value - base) / base:+.1f} % vs dense Adam")


if __name__ == "__main__":
    main()
