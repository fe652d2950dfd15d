"""Padding waste of the training and log-prob forwards: micro-batches in row order, grouped by
length (``--length-grouping``) and packed (``--sequence-packing``), side by side in one
process.

    python benchmarks/padding_rl.py                  # 3 repeats, 64 rows, micro-batches of 8
    python benchmarks/padding_rl.py --repeats 5 --json out.json

The workload is an RL step's batch on the ``word_problems`` task (GSM8K-style stories), with
``--max-new-tokens`` = ``--budget-factor`` × the median length of the task's reference
answer: ``--failed-fraction`` of the completions run to that budget (a failed answer of a
reasoning model), the others are the task's reference answer and EOS (a right answer stops
early; failed ones are random ids: the forwards' cost depends on the shapes only). One
rank (CPU, gloo), a tiny Llama-style policy and its reference; each repeat times the arms
(forward then reverse order): the training phase (forward + backward of every micro-batch,
one Adam step per mini-batch) and the reference log-probs. The packed arm runs Transformer
Engine's THD attention as ``tests/helpers/gpu_standins.py`` stands in for it (a per-row loop on CPU:
its attention is slower than the batched kernel, its linears see fewer tokens). Reported:
median real tokens/s of each phase, the ratios to the plain arm (and the median of
per-repeat ratios), the padded fraction of the slots each phase fed. Results:
docs/benchmarks.md.
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
sys.path.insert(0, os.path.join(ROOT, "tests"))  # gpu_standins: TE's THD attention on CPU


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

    def begin(self, mini):
        return None

    def __call__(self, mini, update=None):
        self.optimizer.step()
        return {}


def _worker(rank, args, tokenizer_path: str) -> dict:
    import gpu_standins
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from loggra_megatron.model.batching import PaddingStats, needed_lengths
    from loggra_megatron.model.log_probs import compute_log_probs
    from loggra_megatron.rl.actor import Actor
    from loggra_megatron.rl.losses import AdaptiveKLCoefficient
    from loggra_megatron.rl.policy_loss import PolicyLossConfig, PPOClipLoss
    from loggra_megatron.testing import tiny_gpt_model, wrap_ddp

    batch, budget, real, vocab, lengths, answer_median = make_batch(args, tokenizer_path)
    seq = batch["tokens"].shape[1]
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, heads=args.heads, vocab=vocab)
    shape.update(seq=seq, use_cpu_initialization=True)
    loss = PPOClipLoss(
        PolicyLossConfig(),
        budget,
        AdaptiveKLCoefficient(0.01),
        ps.get_tensor_model_parallel_group(),
    )

    def actor_and_reference(group: bool, **build):
        policy = wrap_ddp(tiny_gpt_model(**shape, **build), use_distributed_optimizer=False)
        config = OptimizerConfig(optimizer="adam", lr=1e-6, use_distributed_optimizer=False)
        optimizer = get_megatron_optimizer(config, [policy])
        dp, mbs = ps.get_data_parallel_group(), args.micro_batch_size
        actor = Actor(
            policy=policy,
            optimizer=optimizer,
            optimizer_step=_AdamStep(optimizer),
            loss=loss,
            dp_group=dp,
            micro_batch_size=mbs,
            global_batch_size=args.global_batch_size,
            length_grouping=group,
        )
        return actor, tiny_gpt_model(**shape, **build)

    arms = {arm: actor_and_reference(arm == "grouped") for arm in ("plain", "grouped")}
    gpu_standins.install_transformer_engine()  # TE's THD attention, as the tests check it
    gpu_standins.ThdDotProductAttention.dtype_rule = False  # fp32 on CPU
    arms["packed"] = actor_and_reference(False, use_te=True, sequence_packing=True)
    times = {arm: {"train": [], "logprobs": []} for arm in arms}
    padded = {arm: {} for arm in arms}
    needed = needed_lengths(batch["mask"])
    order = [*arms, *reversed(arms)]  # forward then reverse per repeat: drift hits all
    for _, reference in arms.values():  # warm the allocator
        compute_log_probs(reference, batch["tokens"], micro_batch_size=8)
    for _ in range(args.repeats):
        for arm in order[: len(arms) if args.repeats == 1 else None]:
            actor, reference = arms[arm]
            t0 = time.perf_counter()
            metrics = actor.update_policy(batch, ppo_epochs=1)
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
    facts = dict(real_tokens=real, width=seq, budget=budget, answer_median=answer_median)
    facts.update(completion_lengths=lengths, torch=torch.__version__)
    return dict(times=times, padded=padded, **facts)


def summarize(result: dict) -> dict:
    """Tokens/s medians per arm and phase, each arm's ratio to plain, the padded shares."""
    out = {}
    for phase in ("train", "logprobs"):
        times = {arm: t[phase] for arm, t in result["times"].items()}
        tps = {arm: result["real_tokens"] / statistics.median(t) for arm, t in times.items()}
        out[phase] = {
            "tokens_per_s": tps,
            "padded_fraction": {arm: result["padded"][arm][phase] for arm in tps},
            "runs": min(len(t) for t in times.values()),
        }
        for arm in tps:
            pairs = [p / a for p, a in zip(times["plain"], times[arm], strict=True)]
            out[phase][arm] = {
                "speedup": tps[arm] / tps["plain"],
                "speedup_median_of_pairs": statistics.median(pairs),
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
    arms = list(result["times"])
    print("| phase | arm | padded share | tokens/s | / plain (median of pairs) |")
    print("|---|---|---:|---:|---:|")
    for phase, s in summary.items():
        for arm in arms:
            print(
                f"| {phase} | {arm} | {s['padded_fraction'][arm]:.3f} | "
                f"{s['tokens_per_s'][arm]:.0f} | {s[arm]['speedup']:.2f}x "
                f"({s[arm]['speedup_median_of_pairs']:.2f}x) |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "result": result, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
