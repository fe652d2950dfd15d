"""Rank sweep on the tiny CPU example: captured energy, reward and optimizer state at
``--loggra-rank`` h/32 … h/4, with the identity projection (the AdamW update) and with
Megatron's dense Adam (``adam``, the memory reference: identity also stores ``Q = I``).

    python benchmarks/rank_sweep.py --out runs/rank_sweep                  # runs + table
    python benchmarks/rank_sweep.py --out runs/rank_sweep --summarize      # table only
    python benchmarks/rank_sweep.py --out runs/rank_sweep --one-seed 8 32  # 1 seed for those
    python benchmarks/rank_sweep.py --out runs/rank_sweep --sketch backward --configs 4 8 16 32 64 adam

Flags: examples/tiny_cpu/run.sh's (read from it; hidden 128). One warm-up (the example's
200 supervised steps at rank 16) is saved and reused (``--no-load-optim``); each run is the
example's 60 GRPO steps with only ``--seed`` and the optimizer settings changed, seed-major;
finished runs are not rerun. Per configuration over its seeds: captured energy per family
(mean over steps of ``loggra/captured_energy/<family>/mean``; min over layers in
parentheses), reward/mean first 5 → last 5 steps, the last 5 over the identity run's of the
same seed, reward/accuracy of the last 5, ``memory/optimizer_state_bytes`` (logged: exact
state bytes of rank 0) over identity's and dense Adam's, and the step at which each run
would warn (``train.reporting.EnergyWatch`` at the default threshold). ± : std over seeds.
``--sketch backward``: the ranks run LoGRA as published (``--loggra-sketch backward``; no
captured energy, its columns are "–"), in their own run folders.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from tiny_example import example_flags, with_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("qkv", "proj", "fc1", "fc2")
CONFIGS = ("4", "8", "16", "32", "64", "identity", "adam")
LOGGRA_FLAGS = ("--loggra-rank", "--loggra-min-dim", "--loggra-update-interval")
STEPS = 60


def rl_flags(flags: list[str]) -> list[str]:
    """The example's flags for an RL run from the saved warm-up (no warm-up, no saves)."""
    return with_flags(flags, sft_iters=None, sft_lr=None, save_interval=None)


GRADIENT = {"loggra_sketch": "gradient", "loggra_min_dim": 32, "loggra_update_interval": 50}
"""The gradient sketch's settings of the rank configurations (the tiny example's before the
backward sketch became the default)."""


def run_flags(config: str, flags: list[str], sketch: str = "gradient") -> list[str]:
    if config == "adam":  # Megatron's dense Adam: the --loggra-* flags do not apply (refused)
        names = {f[2:].replace("-", "_"): None for f in LOGGRA_FLAGS}
        return with_flags(flags, optimizer="adam", **names)
    if config == "identity":  # rank and refresh interval do not apply (refused)
        identity = {**GRADIENT, "loggra_update_interval": None}
        return with_flags(flags, **identity, loggra_projection="identity", loggra_rank=None)
    if sketch == "backward":  # the default mode
        return with_flags(flags, loggra_rank=config)
    return with_flags(flags, loggra_rank=config, **GRADIENT)


def run_dir(out: str, config: str, seed: int, sketch: str = "gradient") -> str:
    name = config if config in ("identity", "adam") else f"rank{config}"
    if sketch == "backward" and config not in ("identity", "adam"):
        name += "_backward"
    return os.path.join(out, name, f"seed{seed}")


def finished(path: str) -> bool:
    metrics = os.path.join(path, "metrics.jsonl")
    return os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= STEPS


def launch(flags: list[str], log: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    with open(log, "w") as out:
        subprocess.run(
            [*cmd, "2", os.path.join(ROOT, "pretrain_rl.py"), *flags],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def run_all(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    tokenizer = os.path.join(args.out, "tokenizer")
    if not os.path.exists(f"{tokenizer}.model"):
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--builtin-tasks"]
            + ["20000", "--seed", "0", "--vocab-size", "256", "--output-prefix", tokenizer],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    flags = with_flags(example_flags(), tokenizer_model=f"{tokenizer}.model")
    warmup = os.path.join(args.out, "warmup")
    if not os.path.exists(os.path.join(warmup, "latest_checkpointed_iteration.txt")):
        print("== supervised warm-up", flush=True)
        launch(with_flags(flags, train_iters=0, save=warmup), os.path.join(args.out, "warmup.log"))
    rl = rl_flags(flags)
    for s, seed in enumerate(args.seeds):
        for config in args.configs:
            path = run_dir(args.out, config, seed, args.sketch)
            if (s and config in args.one_seed) or finished(path):
                continue
            print(f"== {config}, seed {seed}", flush=True)
            os.makedirs(path, exist_ok=True)
            run = run_flags(config, rl, args.sketch) + ["--load", warmup, "--no-load-optim"]
            launch(run + ["--seed", str(seed), "--output-dir", path], os.path.join(path, "run.log"))


def summarize(args) -> None:
    from loggra_megatron.metrics import read_metrics
    from loggra_megatron.optim.config import LoGRAConfig
    from loggra_megatron.train.reporting import EnergyWatch

    def mean(values):
        return statistics.mean(values) if values else float("nan")

    def energy(rows, family, stat):
        return mean([r[k] for r in rows if (k := f"loggra/captured_energy/{family}/{stat}") in r])

    table = {}
    for config in args.configs:
        paths = {s: run_dir(args.out, config, s, args.sketch) for s in args.seeds}
        runs = {s: read_metrics(path) for s, path in paths.items() if finished(path)}
        if runs:
            table[config] = runs

    def pm(values):  # ± the standard deviation over seeds
        return f" ± {statistics.pstdev(values):.3f}" if len(values) > 1 else ""

    def last5(rows):
        return mean([r["reward/mean"] for r in rows[-5:]])

    def state(runs):
        return mean([rows[-1]["memory/optimizer_state_bytes"] for rows in runs.values()])

    def warned(rows):  # the step at which the run's warning fires (EnergyWatch, default X)
        watch = EnergyWatch(LoGRAConfig().loggra_energy_warn_threshold)
        return next((str(r["step"]) for r in rows if watch.update(r) is not None), "–")

    ident, adam = table.get("identity", {}), table.get("adam", {})
    print("\n| rank | seeds | " + " | ".join(f"energy {f} (min)" for f in FAMILIES), end="")
    print(" | reward first 5 → last 5 | reward vs identity | accuracy last 5 | KL to ref", end="")
    print(" | optimizer state (rank 0) | vs identity | vs dense Adam | S buffer | warns at step |")
    print("|---|---:|" + "---:|" * (len(FAMILIES) + 9))
    for config, runs in table.items():
        cells = []
        for f in FAMILIES:
            m = mean([energy(r, f, "mean") for r in runs.values()])
            low = mean([energy(r, f, "min") for r in runs.values()])
            cells.append("–" if m != m else f"{m:.3f} ({low:.3f})")
        first = mean([mean([r["reward/mean"] for r in rows[:5]]) for rows in runs.values()])
        last = [last5(rows) for rows in runs.values()]
        acc = mean([mean([r["reward/accuracy"] for r in rows[-5:]]) for rows in runs.values()])
        kl = mean([mean([r["kl/ref"] for r in rows[-5:]]) for rows in runs.values()])
        paired = [last5(rows) / last5(ident[s]) for s, rows in runs.items() if s in ident]
        spread = pm(last)
        label = {"identity": "identity (AdamW update)", "adam": "Megatron dense Adam"}.get(
            config, f"{config} (h/{128 // int(config) if config.isdigit() else 1})"
        )
        ratios = [f"{state(runs) / state(base):.3f}" if base else "–" for base in (ident, adam)]
        sketch = mean([rows[-1].get("memory/sketch_buffer_bytes", 0.0) for rows in runs.values()])
        ratios.append(f"{sketch / 2**20:.2f} MiB")  # the backward sketch's S (0 otherwise)
        print(
            f"| {label} | {len(runs)} | {' | '.join(cells)} | {first:.3f} → {mean(last):.3f}"
            f"{spread} | {mean(paired):.3f}{pm(paired)} | {acc:.3f} | {kl:.4f} | "
            f"{state(runs) / 2**20:.2f} MiB | "
            + " | ".join(ratios)
            + f" | {', '.join(warned(rows) for rows in runs.values())} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/rank_sweep")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument(
        "--one-seed", nargs="*", default=[], choices=CONFIGS, help="run only the first seed"
    )
    ap.add_argument(
        "--sketch",
        choices=("gradient", "backward"),
        default="gradient",
        help="--loggra-sketch of the rank configurations",
    )
    ap.add_argument("--summarize", action="store_true", help="only print the table")
    args = ap.parse_args()
    if not args.summarize:
        run_all(args)
    summarize(args)


if __name__ == "__main__":
    main()
