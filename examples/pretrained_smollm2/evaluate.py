"""Held-out greedy accuracy of a Hugging Face model directory, with transformers.

    python examples/pretrained_smollm2/evaluate.py --model runs/pretrained_smollm2/hf \\
        --data runs/pretrained_smollm2/data/eval.jsonl --max-new-tokens 64 --out before.json

Each prompt is rendered as ``pretrain_rl.py`` renders it (the tokenizer's chat template,
``PromptRenderer``), completed greedily up to ``--max-new-tokens`` or a stop id, and scored
with a built-in reward (``--reward-fn``, default ``last_number``; correct at reward 1), as
the trainer's ``--eval-data-path`` evaluation scores it. Prints the accuracy and the first
``--show`` completions, and writes them all to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def _greedy(model, prompts: list[list[int]], max_new_tokens: int, stop_ids, pad: int):
    """Greedy completions (token ids up to the first stop id) of prompts of equal length,
    as one batch: no padding, so each row is computed as it would be alone."""
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids),
            pad_token_id=pad,
        )
    completions = []
    for row in out[:, ids.shape[1] :].tolist():
        ends = [i for i, t in enumerate(row) if t in stop_ids]
        completions.append(row[: ends[0]] if ends else row)
    return completions


def evaluate(model_dir: str, data: str, max_new_tokens: int, reward_fn: str) -> dict:
    import torch
    import transformers

    from loggra_megatron.data.prompts import PromptDataset, PromptRenderer, prompt_text
    from loggra_megatron.data.tokenizer import load_tokenizer
    from loggra_megatron.tasks import TASKS
    from loggra_megatron.tasks.rewards import load_reward_fn

    tok = load_tokenizer(model_dir)
    renderer = PromptRenderer(tok, TASKS["jsonl"](), chat=True)
    score = load_reward_fn(reward_fn)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    examples = PromptDataset.from_files(data).examples
    ids = [renderer.ids(e["prompt"]) for e in examples]
    completions: dict[int, list[int]] = {}
    for length in sorted({len(i) for i in ids}):  # one batch per prompt length
        group = [k for k, i in enumerate(ids) if len(i) == length]
        done = _greedy(model, [ids[k] for k in group], max_new_tokens, tok.stop_ids, tok.pad)
        completions.update(zip(group, done, strict=True))
    rows = []
    for k, example in enumerate(examples):
        completion = tok.detokenize(completions[k])
        question = prompt_text(example["prompt"])
        reward = float(score(question, completion, example["answer"], example["metadata"]))
        rows.append(
            {"question": question, "answer": example["answer"], "completion": completion}
            | {"reward": reward}
        )
    accuracy = sum(r["reward"] >= 1.0 for r in rows) / len(rows)
    return {"model": model_dir, "accuracy": accuracy, "n": len(rows), "samples": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--data", required=True, help="held-out prompts (JSONL or Parquet)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reward-fn", default="last_number", help="as pretrain_rl.py's --reward-fn")
    p.add_argument("--show", type=int, default=4, help="completions to print")
    p.add_argument("--out", help="write the result here (JSON)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.model):
        p.error(f"--model {args.model}: not a directory")
    t0 = time.perf_counter()
    try:
        result = evaluate(args.model, args.data, args.max_new_tokens, args.reward_fn)
    except (ValueError, FileNotFoundError) as e:  # the data, the tokenizer or the reward
        p.error(f"{e}")
    for row in result["samples"][: args.show]:
        print(f"  {row['question']} -> {row['completion']!r} (reward {row['reward']:g})")
    print(
        f"held-out greedy accuracy of {args.model}: {result['accuracy']:.3f} "
        f"({round(result['accuracy'] * result['n'])}/{result['n']}, "
        f"{time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
