"""Single-digit sums as chat-message prompts, with a held-out split of distinct questions.

    python examples/pretrained_smollm2/make_data.py --out runs/pretrained_smollm2/data

writes ``OUT/train.jsonl`` and ``OUT/eval.jsonl``: every ``What is a + b?`` with
``a, b`` in 0..9 (100 questions, drawn with the project's arithmetic generator), shuffled
with ``--seed``; the first ``--num-eval`` questions are held out and never trained on. A
prompt is one user message, the question alone (no answer format asked for): the model
answers in its own words and the ``last_number`` reward reads its final number.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from loggra_megatron.tasks import generate_tasks, write_jsonl  # noqa: E402


def single_digit_sums() -> list[dict]:
    """The 100 distinct questions, in a fixed order."""
    unique: dict[str, dict] = {}
    for example in generate_tasks(
        "arithmetic", 5000, seed=0, num_digits=1, operators="+", allow_negative=False
    ):
        unique.setdefault(example["prompt"], example)
    if len(unique) != 100:
        raise RuntimeError(f"the generator gave {len(unique)} distinct sums, not 100")
    return [unique[q] for q in sorted(unique)]


def as_chat(example: dict) -> dict:
    return {**example, "prompt": [{"role": "user", "content": example["prompt"]}]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--num-eval", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.num_eval < 100:
        p.error(f"--num-eval {args.num_eval}: must be in 1..99 (there are 100 questions)")
    examples = single_digit_sums()
    random.Random(args.seed).shuffle(examples)
    held_out, train = examples[: args.num_eval], examples[args.num_eval :]
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(map(as_chat, train), os.path.join(args.out, "train.jsonl"))
    write_jsonl(map(as_chat, held_out), os.path.join(args.out, "eval.jsonl"))
    print(f"wrote {args.out}/train.jsonl ({len(train)}) and eval.jsonl ({len(held_out)} held out)")


if __name__ == "__main__":
    main()
