"""Per-sample cost of running a user reward function in worker processes (``--reward-fn
module:function``: ``tasks.reward_workers``) against calling it in the trainer's process.

    python benchmarks/reward_workers.py [--samples 2000] [--batch-size 250]

Two rewards defined here (loaded by this file's ``path:function``, as ``--reward-fn`` loads
one): ``trivial`` (a comparison) and ``busy_1ms`` (computes for 1 ms, holding the GIL).
Each is scored through ``Scoring.score`` as the trainer scores a rollout batch, ``--samples``
samples in batches of ``--batch-size``: in this process, then with 1 and 2 workers (started
and warmed by one batch first, which is not timed). Prints microseconds per sample, each
pool's ratio to the in-process time, and how long the workers took to start.
"""

from __future__ import annotations

import argparse
import os
import time


def trivial(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    return float(completion == answer)


def busy_1ms(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    end = time.perf_counter() + 1e-3
    while time.perf_counter() < end:
        pass
    return 1.0


def _batch(size: int) -> tuple[list, list, list, list]:
    prompts = [f"What is {i} + {i}?" for i in range(size)]
    completions = [f"{i} + {i} = {2 * i}.\n#### {2 * i}" for i in range(size)]
    answers = [f"{i} + {i} = {2 * i}.\n#### {2 * i}" if i % 2 else "no" for i in range(size)]
    return prompts, completions, answers, [{"index": i} for i in range(size)]


def _per_sample_us(scoring, samples: int, batch_size: int) -> float:
    """Microseconds per sample of scoring ``samples`` samples in batches of ``batch_size``."""
    batch = _batch(batch_size)
    start = time.perf_counter()
    for _ in range(samples // batch_size):
        scores = scoring.score(*batch)
        assert not scores.errors, scores.errors[0]
    return (time.perf_counter() - start) / (samples // batch_size * batch_size) * 1e6


def measure(name: str, samples: int, batch_size: int) -> dict[str, float]:
    """In-process and 1- and 2-worker microseconds per sample of reward ``name``, and the
    workers' start-up seconds."""
    from loggra_megatron.tasks.reward_workers import RewardWorkers
    from loggra_megatron.tasks.rewards import load_reward_fn
    from loggra_megatron.tasks.scoring import Scoring

    spec = f"{os.path.abspath(__file__)}:{name}"
    fn = load_reward_fn(spec)
    row = {"in process": _per_sample_us(Scoring(fn, None, 1.0), samples, batch_size)}
    for processes in (1, 2):
        workers = RewardWorkers(spec, processes, timeout=60.0)
        scoring = Scoring(fn, None, 1.0, workers=workers)
        start = time.perf_counter()
        scoring.score(*_batch(batch_size))  # start and warm the workers
        row[f"start {processes}"] = time.perf_counter() - start
        row[f"{processes} worker"] = _per_sample_us(scoring, samples, batch_size)
        workers.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=250)
    args = parser.parse_args()
    print(f"{args.samples} samples in batches of {args.batch_size}; µs per sample")
    print("| reward | in process | 1 worker | ratio | 2 workers | ratio | workers' start (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ("trivial", "busy_1ms"):
        r = measure(name, args.samples, args.batch_size)
        base = r["in process"]
        print(
            f"| `{name}` | {base:.1f} | {r['1 worker']:.1f} | {r['1 worker'] / base:.2f} | "
            f"{r['2 worker']:.1f} | {r['2 worker'] / base:.2f} | "
            f"{r['start 1']:.2f} / {r['start 2']:.2f} |"
        )


if __name__ == "__main__":
    main()
