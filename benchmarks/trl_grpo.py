"""The peer arm of ``benchmarks/pretrained_rl.py``: TRL's ``GRPOTrainer`` on the same work.

    python benchmarks/trl_grpo.py --model runs/smol --out runs/smol_bench/TRL_GRPOTrainer/seed1 \\
        --seed 1 --steps 20 --max-new-tokens 32

The same model (``MODEL/hf``, fp32 weights), the same training prompts (``MODEL/data/
train.jsonl``, chat messages rendered by the model's own template), the same reward
(``last_number``), 8 prompts × 4 generations per step, one AdamW update per step
(per-device batch 8, 4 accumulation steps), lr 1e-5 held constant as the other arms hold it,
gradient clipping at 1, temperature 1, no reference model (``beta=0``), on the CPU; TRL's
defaults otherwise (its ``dapo`` token-mean loss, group-scaled rewards, activation
checkpointing of every layer), as a new user would run it. Writes the trained model (fp32) to ``OUT/hf_out``, the same weights rounded to
bf16 to ``OUT/hf_out_bf16``, and one row per step to ``OUT/run/metrics.jsonl`` under the keys
``pretrain_rl.py`` writes (``reward/mean``, ``time/step_s``, ``throughput/tokens_per_s``,
``grad/clipped``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _dataset(path: str):
    import datasets

    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]
    )


def _reward(completions, answer, **_) -> list[float]:
    """``last_number`` on each completion's text (TRL passes chat completions as messages)."""
    from loggra_megatron.tasks.rewards import last_number_reward

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [last_number_reward("", t, a, {}) for t, a in zip(texts, answer, strict=True)]


class _StepRows:
    """A ``TrainerCallback`` that writes ``metrics.jsonl`` rows: each step's wall time, and
    TRL's logged reward, token count and gradient norm."""

    def __init__(self, path: str):
        from transformers import TrainerCallback

        self.path, self.t0, self.tokens = path, 0.0, 0.0
        parent = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                parent.t0 = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kw):
                parent.write(state.global_step, logs or {})

        self.callback = Callback()

    def write(self, step: int, logs: dict) -> None:
        if "reward" not in logs:
            return
        seconds = time.perf_counter() - self.t0
        tokens = logs.get("num_tokens", 0.0) - self.tokens
        self.tokens = logs.get("num_tokens", 0.0)
        row = {
            "step": step,
            "reward/mean": logs["reward"],
            "time/step_s": seconds,
            "throughput/tokens_per_s": tokens / seconds,
            "grad/clipped": float(logs.get("grad_norm", 0.0) > 1.0),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="the example's output folder (OUT of run.sh)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    os.makedirs(os.path.join(args.out, "run"), exist_ok=True)
    rows = _StepRows(os.path.join(args.out, "run", "metrics.jsonl"))
    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"),
        **dict(use_cpu=True, bf16=False, seed=args.seed, max_steps=args.steps),
        **dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=4),
        **dict(learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=1.0, beta=0.0),
        **dict(max_completion_length=args.max_new_tokens, temperature=1.0, num_iterations=1),
        **dict(logging_steps=1, report_to="none", save_strategy="no"),
    )
    model = AutoModelForCausalLM.from_pretrained(f"{args.model}/hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(f"{args.model}/hf")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=config,
        train_dataset=_dataset(f"{args.model}/data/train.jsonl"),
        processing_class=tokenizer,
        callbacks=[rows.callback],
    )
    trainer.train()
    trainer.save_model(os.path.join(args.out, "hf_out"))
    model.to(torch.bfloat16).to(torch.float32)  # the same weights, rounded to bf16
    model.save_pretrained(os.path.join(args.out, "hf_out_bf16"))
    tokenizer.save_pretrained(os.path.join(args.out, "hf_out_bf16"))


if __name__ == "__main__":
    main()
