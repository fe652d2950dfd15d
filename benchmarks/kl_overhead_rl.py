"""Predicted-KL control's cost in a whole RL run: the tiny CPU example with and without
``--kl-target``, side by side in one invocation.

    python benchmarks/kl_overhead_rl.py                       # 3 repeats each, 30 RL steps
    python benchmarks/kl_overhead_rl.py --repeats 5 --json out.json
    python benchmarks/kl_overhead_rl.py --arms plain,probing  # without probe skipping only

Four arms: plain; ``--kl-target`` probing every update (``--kl-probe-skip-below 0``) with
``kl/realized`` every update (the controller before probe skipping); with probe skipping; and
with the defaults (probe skipping, ``kl/realized`` every 4th update). The method
(ABBA-style repeats of ``examples/tiny_cpu/run.sh``'s command) and what is reported:
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

from tiny_example import example_flags, with_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EXAMPLE = with_flags(
    example_flags(), kl_target=None, train_iters=None, save_interval=None, tokenizer_model=None
)
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


ARMS = {
    "plain": [],
    "probing": ["--kl-probe-skip-below", "0", "--kl-realized-interval", "1"],  # no probe skipping
    "skipping": ["--kl-realized-interval", "1"],  # probe skipping, kl/realized every update
    "realized4": [],  # the defaults: probe skipping, kl/realized every 4th update
}
"""The arms: no control, control that probes every update, control with probe skipping,
the same with ``kl/realized`` every 4th update (all but the first get ``--kl-target``)."""


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-iters", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="first RL steps left out")
    ap.add_argument("--kl-target", type=float, default=0.02)
    ap.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}"
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.arms = args.arms.split(",")
    if "plain" not in args.arms or not set(args.arms) <= set(ARMS) or len(args.arms) < 2:
        ap.error(f"--arms: plain and at least one of {', '.join(ARMS)}")
    return args


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
    """The arms ``args.repeats`` times, in forward then reverse order (ABBA for two arms):
    per arm, each run's kept metric rows."""
    with tempfile.TemporaryDirectory(prefix="kl_overhead_") as tmp:
        tok = train_tokenizer(tmp)
        runs = {name: [] for name in args.arms}
        for i in range(args.repeats):  # each arm goes first in every other repeat
            for name in args.arms if i % 2 == 0 else args.arms[::-1]:
                extra = ARMS[name] + (["--kl-target", str(args.kl_target)] * (name != "plain"))
                rows = run(tmp, tok, f"{name}{i}", args.train_iters, extra)[args.skip :]
                runs[name].append(rows)
                tps = statistics.median(r["throughput/tokens_per_s"] for r in rows)
                print(f"repeat {i + 1} {name:10s}: {tps:8.0f} tokens/s", flush=True)
    return runs


def _tokens_per_s(rows) -> float:
    return statistics.median(r["throughput/tokens_per_s"] for r in rows)


def summarize_controlled(runs: dict[str, list[list]], name: str) -> dict:
    """One controlled arm against the plain one: tokens/s ratios (pooled and within each
    repeat), the controller's share of a step, the scaled and probe-skipped updates."""
    rows = [r for run in runs[name] for r in run]
    shares = sorted(r["time/kl_control_s"] / r["time/step_s"] for r in rows)
    paired = [
        _tokens_per_s(c) / _tokens_per_s(p) for c, p in zip(runs[name], runs["plain"], strict=True)
    ]
    plain = statistics.median(_tokens_per_s(run) for run in runs["plain"])
    return {
        "tokens_per_s": statistics.median(_tokens_per_s(run) for run in runs[name]),
        "ratio": statistics.median(_tokens_per_s(run) for run in runs[name]) / plain,
        "paired_ratios": paired,
        "paired_ratio_median": statistics.median(paired),
        "kl_control_share_median": statistics.median(shares),
        "kl_control_share_p90": shares[int(0.9 * (len(shares) - 1))],
        "scaled_steps": statistics.mean(r["kl/step_scale"] < 1 for r in rows),
        # per RL step: how many of its updates skipped the probe (0 before the key existed)
        "probe_skipped_per_step": statistics.mean(r.get("kl/probe_skipped", 0.0) for r in rows),
        "steps": len(rows),
    }


def summarize(args, runs: dict[str, list[list]]) -> dict:
    """Per arm the median s/step of each phase (the noise shows in the rollout, whose work
    is the same in every arm); per controlled arm ``summarize_controlled``."""
    phases = {
        k: {
            key: statistics.median(r[key] for rows in v for r in rows)
            for key in ("time/rollout_s", "time/train_s", "time/step_s")
        }
        for k, v in runs.items()
    }
    return {
        "tokens_per_s_plain": statistics.median(_tokens_per_s(run) for run in runs["plain"]),
        "controlled": {k: summarize_controlled(runs, k) for k in runs if k != "plain"},
        "phases_s": phases,
        "repeats": args.repeats,
        "train_iters": args.train_iters,
        "skip": args.skip,
    }


def report(args, result: dict) -> None:
    print(
        f"\n{args.repeats} repeats, --kl-target {args.kl_target}; plain arm: "
        f"{result['tokens_per_s_plain']:.0f} tokens/s (median over steps, then repeats)"
    )
    print(
        "| arm | tokens/s | ratio to plain | within-repeat ratios (median) | "
        "time/kl_control_s / time/step_s median (p90) | scaled | probe skipped per RL step |"
    )
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, c in result["controlled"].items():
        paired = ", ".join(f"{r:.3f}" for r in c["paired_ratios"])
        print(
            f"| {name} | {c['tokens_per_s']:.0f} | {c['ratio']:.3f} | {paired} "
            f"({c['paired_ratio_median']:.3f}) | {100 * c['kl_control_share_median']:.1f} % "
            f"({100 * c['kl_control_share_p90']:.1f} %) | {100 * c['scaled_steps']:.0f} % | "
            f"{c['probe_skipped_per_step']:.2f} |"
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
