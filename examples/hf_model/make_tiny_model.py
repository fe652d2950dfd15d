"""Make a tiny Qwen2-style Hugging Face model directory, offline, and a math dataset.

    python examples/hf_model/make_tiny_model.py --out runs/hf_model

writes ``OUT/hf`` (``config.json``, ``model.safetensors``, a byte-level BPE
``tokenizer.json`` with Qwen's chat template and special tokens, ``generation_config.json``
with both stop ids) and ``OUT/data/{train,eval}.parquet`` (chat-message prompts, math answers
such as ``1/2`` checked by math-verify). Nothing is downloaded: the tokenizer is trained with
``tokenizers`` on the generated problems and the model is randomly initialised.
"""

from __future__ import annotations

import argparse
import json
import os
import random

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def math_problems(n: int, seed: int) -> list[dict]:
    """Fractions and sums whose answers math-verify compares symbolically."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        if rng.random() < 0.5:
            question, answer, solution = f"What is {a} divided by {b}?", f"{a}/{b}", f"{a}/{b}"
        else:
            c = rng.randint(1, 9)
            question, answer, solution = f"What is {a} + {c}?", str(a + c), f"{a} + {c} = {a + c}"
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "answer": answer,
                "solution": f"{solution}.",
            }
        )
    return rows


def build_tokenizer(out: str, texts: list[str], vocab_size: int = 400) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)


def build_model(out: str, seed: int = 0) -> None:
    """A random Qwen2 model over the tokenizer in ``out``; both stop ids in its generation
    config (as Qwen's chat models have)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    stop = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    vocab_size = len(tok)

    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": stop, "pad_token_id": stop[1]}, f)


def write_parquet(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num-train", type=int, default=256)
    p.add_argument("--num-eval", type=int, default=32)
    args = p.parse_args(argv)
    train, held_out = math_problems(args.num_train, 0), math_problems(args.num_eval, 1)
    hf = os.path.join(args.out, "hf")
    texts = [m["content"] + " " + r["solution"] for r in train for m in r["prompt"]]
    build_tokenizer(hf, texts)
    build_model(hf)
    write_parquet(train, os.path.join(args.out, "data", "train.parquet"))
    write_parquet(held_out, os.path.join(args.out, "data", "eval.parquet"))
    print(f"wrote {hf} and {args.out}/data/{{train,eval}}.parquet")


if __name__ == "__main__":
    main()
