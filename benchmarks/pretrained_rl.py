"""A real pretrained model, side by side: SmolLM2-135M-Instruct trained with GRPO on
single-digit sums by dense Adam, LoGRA (the default: the backward sketch), both in fp32 and in
bf16 weights, LoGRA's published RL recipe (bf16), and, where ``trl`` is installed, TRL's
GRPOTrainer as the peer (``benchmarks/trl_grpo.py``), over seeds, each from the same
converted checkpoint.

    bash examples/pretrained_smollm2/run.sh runs/smol   # once: packages, model, data, base
    python benchmarks/pretrained_rl.py --model runs/smol --out runs/smol_bench --seeds 1 2 3
    python benchmarks/pretrained_rl.py --model runs/smol --out runs/smol_bench --summarize

Every arm runs ``examples/pretrained_smollm2/run.sh``'s training command (one process, 32
sequences per step, lr 1e-5 where an arm has a learning rate, fp32 or bf16 weights, the
``last_number`` reward, ``--eval-data-path`` on the 32 held-out questions after the last
step) with its optimizer flags, from ``MODEL/mcore``; the recipe arm reads
``examples/paper_recipe/loggra_rl.yaml`` (one response per prompt, so 32 prompts per step).
Each run is then exported to Hugging Face and scored greedily with transformers (``evaluate.py``), as the base model was
(``MODEL/eval_before.json``). Peak memory is the training process's largest resident set,
polled every 0.1 s; step time and tokens/s are medians over the run's steps after the first
(``time/step_s``, ``throughput/tokens_per_s``). The summary is a Markdown table (mean ± std
over seeds) and, with ``--plot``, the reward and accuracy curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pretrained_smollm2")
RECIPE = os.path.join(ROOT, "examples", "paper_recipe", "loggra_rl.yaml")
RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform")
RECOMPUTE += ("--recompute-num-layers", "1")
"""Every layer's activations recomputed in the backward, as TRL's GRPOTrainer does by default
(``gradient_checkpointing=True``)."""
ARMS = {
    "dense Adam": ["--optimizer", "adam"],
    "LoGRA": ["--optimizer", "loggra"],
    "dense Adam, bf16": ["--optimizer", "adam", "--bf16"],
    "LoGRA, bf16": ["--optimizer", "loggra", "--bf16"],
    "LoGRA, activation recompute": ["--optimizer", "loggra", *RECOMPUTE],
    "dense Adam, activation recompute": ["--optimizer", "adam", *RECOMPUTE],
    "LoGRA, paper recipe": [  # bf16 (its config): predicted-KL control tries 16-bit weights
        *("--config", RECIPE, "--loggra-rank", "64"),
        *("--num-generations", "1", "--prompts-per-step", "32"),
    ],
}
"""Each arm's flags over ``common``'s: fp32 weights as the example trains, or bf16 weights
(the recipe's: its config, a rank for hidden 576, and as many sequences per step as the
others); with activation recompute, as the peer runs."""
PEER = "TRL GRPOTrainer"
"""The peer arm (``benchmarks/trl_grpo.py``, where ``trl`` is installed): fp32 weights; its
accuracy is also scored with the weights rounded to bf16."""


def all_arms() -> list[str]:
    """Our arms, and the peer's where ``trl`` is installed."""
    import importlib.util

    return [*ARMS, *([PEER] if importlib.util.find_spec("trl") else [])]


def common(model: str, steps: int, max_new_tokens: int) -> list[str]:
    """The example's training flags (``examples/pretrained_smollm2/run.sh``)."""
    return [
        *("--tokenizer-model", f"{model}/hf", "--data-path", f"{model}/data/train.jsonl"),
        *("--reward-fn", "last_number", "--eval-data-path", f"{model}/data/eval.jsonl"),
        *("--eval-interval", str(steps), "--seq-length", "96"),
        *("--max-new-tokens", str(max_new_tokens), "--prompts-per-step", "8"),
        *("--num-generations", "4", "--global-batch-size", "32", "--micro-batch-size", "8"),
        *("--train-iters", str(steps), "--lr", "1e-5"),
    ]


def run_dir(out: str, arm: str, seed: int) -> str:
    return os.path.join(out, arm.replace(" ", "_").replace(",", ""), f"seed{seed}")


def _peak_rss(proc: subprocess.Popen) -> int:
    """Wait for ``proc``; the largest resident set of any process of its tree, in bytes."""
    import psutil

    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max([peak, *(p.memory_info().rss for p in tree)])
        except psutil.Error:
            pass
        time.sleep(0.1)
    return peak


def _command(args, arm: str, seed: int, out: str) -> list[str]:
    """The training command of one arm and seed: ``pretrain_rl.py`` with the arm's flags, or
    the peer's script (which writes its own Hugging Face export)."""
    if arm == PEER:
        return [
            *(sys.executable, os.path.join(ROOT, "benchmarks", "trl_grpo.py")),
            *("--model", args.model, "--out", out, "--seed", str(seed)),
            *("--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens)),
        ]
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"),
        os.path.join(ROOT, "pretrain_rl.py"),
        *common(args.model, args.steps, args.max_new_tokens),
        *ARMS[arm],
        *("--load", f"{args.model}/mcore", "--save", f"{out}/run", "--seed", str(seed)),
    ]


def _export(args, out: str) -> None:
    """The run's last checkpoint as a Hugging Face directory with the model's tokenizer."""
    hf = os.path.join(out, "hf_out")
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py")]
        + ["--direction", "megatron-to-hf", "--load", f"{out}/run", "--save", hf],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = os.path.join(args.model, "hf", name)
        if os.path.exists(src):
            subprocess.run(["cp", src, hf], check=True)


def _score(args, hf: str, path: str) -> None:
    subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, "evaluate.py"), "--model", hf]
        + ["--data", f"{args.model}/data/eval.jsonl", "--out", path]
        + ["--max-new-tokens", str(args.max_new_tokens), "--show", "0"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def train(args, arm: str, seed: int) -> None:
    """One arm and seed: train, export, score the export; ``result.json`` in its folder."""
    out = run_dir(args.out, arm, seed)
    if os.path.exists(os.path.join(out, "result.json")):
        return
    os.makedirs(out, exist_ok=True)
    cmd = _command(args, arm, seed, out)
    t0 = time.perf_counter()
    with open(os.path.join(out, "train.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        peak = _peak_rss(proc)
    if proc.returncode:
        raise SystemExit(f"{arm}, seed {seed}: training failed, see {out}/train.log")
    wall = time.perf_counter() - t0
    if arm == PEER:
        _score(args, os.path.join(out, "hf_out_bf16"), f"{out}/eval_after_bf16.json")
    else:
        _export(args, out)
    _score(args, os.path.join(out, "hf_out"), f"{out}/eval_after.json")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"peak_rss_bytes": peak, "wall_s": wall, "cmd": cmd}, f, indent=1)


def arm_results(args, arm: str) -> list[dict]:
    """Per seed that finished: the run's metrics and scores."""
    from loggra_megatron.metrics import read_metrics

    found = []
    for seed in args.seeds:
        out = run_dir(args.out, arm, seed)
        if not os.path.exists(os.path.join(out, "result.json")):
            continue
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
        with open(os.path.join(out, "eval_after.json")) as f:
            result["accuracy"] = json.load(f)["accuracy"]
        if os.path.exists(os.path.join(out, "eval_after_bf16.json")):
            with open(os.path.join(out, "eval_after_bf16.json")) as f:
                result["accuracy_bf16"] = json.load(f)["accuracy"]
        result["rows"] = read_metrics(os.path.join(out, "run"))
        found.append(result)
    return found


def _fmt(values, scale=1.0, digits=3) -> str:
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.pstdev(values):.{digits}f}"


def summarize(args) -> None:
    with open(os.path.join(args.model, "eval_before.json")) as f:
        before = json.load(f)["accuracy"]
    print(f"\nbase model: held-out greedy accuracy {before:.3f} (transformers)\n")
    print(
        "| optimizer | seeds | held-out accuracy after | reward, first 5 → last 5 steps "
        "| updates clipped | peak RSS (GiB) | step time (s) | tokens/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arm in [*ARMS, PEER]:
        results = arm_results(args, arm)
        if not results:
            continue

        def per_seed(fn, results=results):
            return [fn(r["rows"]) for r in results]

        first = per_seed(lambda rows: statistics.mean(r["reward/mean"] for r in rows[:5]))
        last = per_seed(lambda rows: statistics.mean(r["reward/mean"] for r in rows[-5:]))
        clipped = per_seed(lambda rows: statistics.mean(r.get("grad/clipped", 0.0) for r in rows))
        step = per_seed(lambda rows: statistics.median(r["time/step_s"] for r in rows[1:]))
        tps = per_seed(
            lambda rows: statistics.median(r["throughput/tokens_per_s"] for r in rows[1:])
        )
        print(
            f"| {arm} | {len(results)} | {_fmt([r['accuracy'] for r in results])} "
            f"| {_fmt(first)} → {_fmt(last)} | {_fmt(clipped, digits=2)} "
            f"| {_fmt([r['peak_rss_bytes'] for r in results], 2**-30, 2)} "
            f"| {_fmt(step, digits=2)} | {_fmt(tps, digits=0)} |"
        )
        if "accuracy_bf16" in results[0]:
            accuracy = _fmt([r["accuracy_bf16"] for r in results])
            print(f"| {arm}, its weights rounded to bf16 | {len(results)} | {accuracy} |||||")
    if args.plot:
        plot(args, before)


def plot(args, before: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in [*ARMS, PEER]:
        results = arm_results(args, arm)
        if not results:
            continue
        steps = [r["step"] for r in results[0]["rows"]]
        mean = [
            statistics.mean(res["rows"][i]["reward/mean"] for res in results)
            for i in range(len(steps))
        ]
        ax_reward.plot(steps, mean, label=arm)
        accuracies = [r["accuracy"] for r in results]
        ax_acc.bar(arm, statistics.mean(accuracies), yerr=statistics.pstdev(accuracies))
    ax_acc.axhline(before, color="gray", linestyle="--", label="base model")
    ax_reward.set(xlabel="RL step", ylabel="reward/mean (mean over seeds)")
    ax_acc.set(ylabel="held-out greedy accuracy after", ylim=(0, 1))
    plt.setp(ax_acc.get_xticklabels(), rotation=20, ha="right")
    ax_reward.legend()
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"\nwrote {args.plot}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="the example's output folder (OUT of run.sh)")
    p.add_argument("--out", default="runs/pretrained_bench")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--arms", nargs="+", default=all_arms(), choices=[*ARMS, PEER], metavar="ARM")
    p.add_argument("--summarize", action="store_true", help="only print the table")
    p.add_argument("--plot", metavar="PNG", help="also draw the curves into this file")
    args = p.parse_args()
    for needed in ("mcore", "hf", "data/train.jsonl", "eval_before.json"):
        if not os.path.exists(os.path.join(args.model, needed)):
            p.error(f"--model {args.model}: no {needed}; run examples/pretrained_smollm2/run.sh")
    if not args.summarize:
        for arm in args.arms:
            for seed in args.seeds:
                print(f"== {arm}, seed {seed}", flush=True)
                train(args, arm, seed)
    summarize(args)


if __name__ == "__main__":
    main()
