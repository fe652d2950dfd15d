"""Padding waste of the training and log-prob forwards, with and without length grouping
(``--length-grouping``), side by side in one process.

    python benchmarks/padding_rl.py                  # 3 repeats, 64 rows, micro-batches of 8
    python benchmarks/padding_rl.py --repeats 5 --json out.json

The workload is an RL step's batch on the ``word_problems`` task (GSM8K-style stories), with
``--max-new-tokens`` = ``--budget-factor`` × the median length of the task's reference
answer: ``--failed-fraction`` of the completions run to that budget (a failed answer of a
reasoning model), the others are the task's reference answer and EOS (a right answer stops
early; failed ones are random ids: the forwards' cost depends on the shapes only). One
rank (CPU, gloo), a tiny Llama-style policy and its reference; each repeat times both arms
(ABBA order): the training phase (forward + backward of every micro-batch, one Adam step per
mini-batch) and the reference log-probs. Reported: median real tokens/s of each phase, the
ratio grouped / plain (and the median of per-repeat ratios), the padded fraction of the
slots each phase fed. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=64, help="sequences of the RL step (one rank)")
    p.add_argument("--global-batch-size", type=int, default=32, help="rows per Adam step")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--log-prob-micro-batch-size", type=int, default=8)
    p.add_argument("--budget-factor", type=float, default=4.0)
    p.add_argument("--failed-fraction", type=float, default=0.5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def make_batch(args, tokenizer_path: str):
    """The step's batch: ``tokens``, ``mask``, ``old``, ``ref``, ``adv`` (the actor's
    training batch) and the max-new-tokens budget."""
    import torch

    from loggra_megatron.data.tokenizer import load_tokenizer
    from loggra_megatron.tasks import TASKS

    tok, task = load_tokenizer(tokenizer_path), TASKS["word_problems"]()
    examples = task.generate(args.rows, args.seed)
    prompts = [tok.tokenize(task.template.format(prompt=e["prompt"])) for e in examples]
    answers = [tok.tokenize(task.reference_completion(e)) + [tok.eos] for e in examples]
    budget = int(args.budget_factor * statistics.median(len(a) for a in answers))
    rng = random.Random(args.seed)
    failed = set(rng.sample(range(args.rows), round(args.failed_fraction * args.rows)))
    rows = []
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        done = a[:budget] if i not in failed else [rng.randrange(tok.vocab_size)] * budget
        rows.append((p, done))
    width = max(len(p) + len(c) for p, c in rows)
    tokens = torch.full((args.rows, width), tok.pad, dtype=torch.long)
    mask = torch.zeros(args.rows, width - 1, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        tokens[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1 : len(p) + len(c) - 1] = True
    gen = torch.Generator().manual_seed(args.seed)

    def logp():
        return torch.where(mask, -3.0 + 0.3 * torch.randn(mask.shape, generator=gen), 0.0)

    real = sum(len(p) + len(c) for p, c in rows)
    batch = {"tokens": tokens, "mask": mask, "old": logp(), "ref": logp()}
    batch["adv"] = torch.randn(args.rows, generator=gen)
    lengths = [len(c) for _, c in rows]
    return batch, budget, real, tok.vocab_size, lengths, statistics.median(map(len, answers))


class _AdamStep:
    """The actor's optimizer step: Megatron's, no predicted-KL control."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def reference_collector(self, num_sequences):
        return None

    def __call__(self, mini, reference=None):
        self.optimizer.step()
        return {}


def _worker(rank, args, tokenizer_path: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.model.batching import PaddingStats, needed_lengths
    from loggra_megatron.rl.actor import Actor
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss
    from loggra_megatron.rollout import compute_log_probs
    from loggra_megatron.testing import tiny_gpt_model, wrap_ddp

    batch, budget, real, vocab, lengths, answer_median = make_batch(args, tokenizer_path)
    seq = batch["tokens"].shape[1]
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, heads=args.heads)
    policy = wrap_ddp(
        tiny_gpt_model(**shape, vocab=vocab, seq=seq, use_cpu_initialization=True),
        use_distributed_optimizer=False,
    )
    reference = tiny_gpt_model(**shape, vocab=vocab, seq=seq, use_cpu_initialization=True)
    config = OptimizerConfig(optimizer="adam", lr=1e-6, use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(config, [policy])
    loss = PPOClipLoss(
        PolicyLossConfig(),
        budget,
        AdaptiveKLCoefficient(0.01),
        ps.get_tensor_model_parallel_group(),
    )
    actors = {
        arm: Actor(
            policy,
            optimizer,
            _AdamStep(optimizer),
            loss,
            ps.get_data_parallel_group(),
            args.micro_batch_size,
            args.global_batch_size,
            length_grouping=arm == "grouped",
        )
        for arm in ("plain", "grouped")
    }
    times = {arm: {"train": [], "logprobs": []} for arm in actors}
    padded = {arm: {} for arm in actors}
    needed = needed_lengths(batch["mask"])
    order = ["plain", "grouped", "grouped", "plain"]  # ABBA per repeat: drift hits both
    compute_log_probs(reference, batch["tokens"], micro_batch_size=8)  # warm the allocator
    for _ in range(args.repeats):
        for arm in order[: 2 if args.repeats == 1 else 4]:
            t0 = time.perf_counter()
            metrics = actors[arm].update_policy(batch, ppo_epochs=1)
            times[arm]["train"].append(time.perf_counter() - t0)
            padded[arm]["train"] = metrics["throughput/padded_token_fraction"]
            stats = PaddingStats()
            t0 = time.perf_counter()
            compute_log_probs(
                reference,
                batch["tokens"],
                micro_batch_size=args.log_prob_micro_batch_size,
                lengths=needed,
                group=arm == "grouped",
                padding=stats,
            )
            times[arm]["logprobs"].append(time.perf_counter() - t0)
            padded[arm]["logprobs"] = stats.fraction
    return {
        "times": times,
        "padded": padded,
        "real_tokens": real,
        "width": seq,
        "budget": budget,
        "answer_median": answer_median,
        "completion_lengths": lengths,
        "torch": torch.__version__,
    }


def summarize(result: dict) -> dict:
    """Tokens/s medians per arm and phase, the grouped / plain ratios, the padded shares."""
    out = {}
    for phase in ("train", "logprobs"):
        plain = result["times"]["plain"][phase]
        grouped = result["times"]["grouped"][phase]
        tps = {
            arm: result["real_tokens"] / statistics.median(t)
            for arm, t in (("plain", plain), ("grouped", grouped))
        }
        n = min(len(plain), len(grouped))
        pairs = [p / g for p, g in zip(plain[:n], grouped[:n], strict=True)]
        out[phase] = {
            "tokens_per_s": tps,
            "speedup": tps["grouped"] / tps["plain"],
            "speedup_median_of_pairs": statistics.median(pairs),
            "padded_fraction": {arm: result["padded"][arm][phase] for arm in tps},
            "runs": n,
        }
    return out


def main() -> None:
    from loggra_megatron.testing import run_distributed

    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="padding_rl_") as tmp:
        prefix = os.path.join(tmp, "tok")
        tool = os.path.join(ROOT, "tools", "train_tokenizer.py")
        flags = ["--builtin-tasks", "5000", "--seed", "0", "--vocab-size", "256", "--output-prefix"]
        subprocess.run([sys.executable, tool, *flags, prefix], check=True, capture_output=True)
        (result,) = run_distributed(_worker, 1, args, prefix + ".model", timeout=3600)
    summary = summarize(result)
    lengths = sorted(result["completion_lengths"])
    print(
        f"{len(lengths)} rows, completions {lengths[0]}..{lengths[-1]} tokens (reference answers: "
        f"median {result['answer_median']:.0f}; budget {result['budget']}), batch width "
        f"{result['width']}, {result['real_tokens']} real tokens; repeats {args.repeats}"
    )
    print("| phase | padded, plain | padded, grouped | tok/s plain | tok/s grouped | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase, s in summary.items():
        pf, tps = s["padded_fraction"], s["tokens_per_s"]
        print(
            f"| {phase} | {pf['plain']:.3f} | {pf['grouped']:.3f} | {tps['plain']:.0f} | "
            f"{tps['grouped']:.0f} | {s['speedup']:.2f}x (pairs {s['speedup_median_of_pairs']:.2f}x) |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "result": result, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
