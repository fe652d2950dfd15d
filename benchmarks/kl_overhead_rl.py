"""Predicted-KL control's cost in a whole RL run: the tiny CPU example with and without
``--kl-target``, side by side in one invocation.

    python benchmarks/kl_overhead_rl.py                       # 3 repeats each, 30 RL steps
    python benchmarks/kl_overhead_rl.py --repeats 5 --json out.json

The method (ABBA repeats of ``examples/tiny_cpu/run.sh``'s command) and what is reported:
``docs/benchmarks.md``, "Predicted-KL step control".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EXAMPLE = [
    "--task",
    "arithmetic",
    "--num-tasks",
    "20000",
    "--task-digits",
    "1",
    "--task-operators",
    "+-",
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--bf16",
    "--sft-iters",
    "200",
    "--sft-lr",
    "3e-3",
    "--prompts-per-step",
    "16",
    "--num-generations",
    "8",
    "--max-new-tokens",
    "16",
    "--global-batch-size",
    "64",
    "--micro-batch-size",
    "32",
    "--lr",
    "1e-4",
    "--lr-warmup-iters",
    "5",
    "--optimizer",
    "loggra",
    "--loggra-rank",
    "16",
    "--loggra-min-dim",
    "32",
    "--loggra-update-interval",
    "50",
    "--kl-coef",
    "0.01",
    "--kl-ref-estimator",
    "k3",
]
"""``examples/tiny_cpu/run.sh``'s flags, less ``--kl-target``, ``--train-iters`` and saving."""


def run(workdir: str, tokenizer: str, name: str, train_iters: int, extra: list[str]) -> list:
    out = os.path.join(workdir, name)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--standalone",
        os.path.join(ROOT, "pretrain_rl.py"),
        "--tokenizer-model",
        tokenizer,
        *EXAMPLE,
        "--train-iters",
        str(train_iters),
        "--output-dir",
        out,
        *extra,
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    from loggra_megatron.metrics import read_metrics

    return read_metrics(out)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-iters", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="first RL steps left out")
    ap.add_argument("--kl-target", type=float, default=0.02)
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args()


def train_tokenizer(tmp: str) -> str:
    """The example's tokenizer, trained into ``tmp``; returns its model file."""
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "train_tokenizer.py"),
            "--builtin-tasks",
            "20000",
            "--seed",
            "0",
            "--vocab-size",
            "256",
            "--output-prefix",
            os.path.join(tmp, "tok"),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return os.path.join(tmp, "tok.model")


def run_arms(args) -> dict[str, list[list]]:
    """Both arms ``args.repeats`` times in ABBA order: per arm, each run's kept metric rows."""
    with tempfile.TemporaryDirectory(prefix="kl_overhead_") as tmp:
        tok = train_tokenizer(tmp)
        runs = {"plain": [], "controlled": []}
        arms = [("plain", []), ("controlled", ["--kl-target", str(args.kl_target)])]
        for i in range(args.repeats):  # ABBA: each arm goes first in every other repeat
            for name, extra in arms if i % 2 == 0 else arms[::-1]:
                rows = run(tmp, tok, f"{name}{i}", args.train_iters, extra)[args.skip :]
                runs[name].append(rows)
                tps = statistics.median(r["throughput/tokens_per_s"] for r in rows)
                print(f"repeat {i + 1} {name:10s}: {tps:8.0f} tokens/s", flush=True)
    return runs


def summarize(args, runs: dict[str, list[list]]) -> dict:
    """Tokens/s (median over steps, then repeats), the ratios, the phases and the
    controller's share of a step."""
    tps = {
        k: statistics.median(
            statistics.median(r["throughput/tokens_per_s"] for r in rows) for rows in v
        )
        for k, v in runs.items()
    }
    phases = {  # median over all kept steps: where the time (and the noise) goes
        k: {
            key: statistics.median(r[key] for rows in v for r in rows)
            for key in ("time/rollout_s", "time/train_s", "time/step_s")
        }
        for k, v in runs.items()
    }
    shares = sorted(
        r["time/kl_control_s"] / r["time/step_s"] for rows in runs["controlled"] for r in rows
    )
    scaled = [r["kl/step_scale"] < 1 for rows in runs["controlled"] for r in rows]
    per_run = {
        k: [statistics.median(r["throughput/tokens_per_s"] for r in rows) for rows in v]
        for k, v in runs.items()
    }
    paired = [c / p for c, p in zip(per_run["controlled"], per_run["plain"], strict=True)]
    return {
        "tokens_per_s": tps,
        "ratio": tps["controlled"] / tps["plain"],
        "phases_s": phases,
        "paired_ratios": paired,
        "paired_ratio_median": statistics.median(paired),
        "kl_control_share_median": statistics.median(shares),
        "kl_control_share_p90": shares[int(0.9 * (len(shares) - 1))],
        "scaled_steps": sum(scaled) / len(scaled),
        "steps": len(shares),
        "repeats": args.repeats,
        "train_iters": args.train_iters,
        "skip": args.skip,
    }


def report(args, result: dict) -> None:
    tps, paired = result["tokens_per_s"], result["paired_ratios"]
    print(
        f"tokens/s median of {args.repeats} runs: plain {tps['plain']:.0f}, "
        f"--kl-target {args.kl_target}: {tps['controlled']:.0f} "
        f"(ratio {result['ratio']:.3f}, {100 * (1 - result['ratio']):+.1f} % cost)"
    )
    print(
        "ratio within each repeat (adjacent runs): "
        + ", ".join(f"{r:.3f}" for r in paired)
        + f"; median {result['paired_ratio_median']:.3f}"
    )
    print(
        f"time/kl_control_s / time/step_s over {result['steps']} steps: median "
        f"{100 * result['kl_control_share_median']:.1f} %, p90 "
        f"{100 * result['kl_control_share_p90']:.1f} %; steps scaled (η<1): "
        f"{100 * result['scaled_steps']:.0f} %"
    )
    for name, times in result["phases_s"].items():
        print(f"{name:10s} median s/step: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))


def main() -> None:
    args = parse_args()
    result = summarize(args, run_arms(args))
    report(args, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
