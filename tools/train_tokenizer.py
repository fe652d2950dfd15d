# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Train a SentencePiece tokenizer (``--tokenizer-model``) for loggra-megatron.

Offline, on generated tasks (prompt template + worked solution + ``#### <answer>``)::

    python tools/train_tokenizer.py --builtin-tasks 20000 --seed 0 \\
        --vocab-size 512 --output-prefix /tmp/tok/math

On your own text files (each line is one training sentence)::

    python tools/train_tokenizer.py --input corpus1.txt corpus2.txt \\
        --vocab-size 32000 --model-type unigram --byte-fallback --output-prefix /data/tok/sp

Digits are always split into single pieces; ``\\n`` and ``####`` are atomic pieces; see
``loggra_megatron.data.tokenizer.train_tokenizer`` for the other settings. Writes
``PREFIX.model`` and ``PREFIX.vocab``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from loggra_megatron.tasks import TASKS, generate_tasks  # noqa: E402  (stdlib only)
from loggra_megatron.tasks.prompt_format import task_texts  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", metavar="FILE", help="UTF-8 text files")
    source.add_argument(
        "--builtin-tasks", type=int, metavar="N", help="train on N generated tasks (offline)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tasks")
    p.add_argument(
        "--task-kind", default="mixed", choices=[k for k, t in TASKS.items() if not t.needs_data]
    )
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model, PREFIX.vocab")
    p.add_argument("--byte-fallback", action="store_true", help="unknown characters as byte pieces")
    p.add_argument(
        "--hard-vocab-limit",
        action="store_true",
        help="fail if the corpus cannot fill --vocab-size (default: accept a smaller vocab)",
    )
    p.add_argument("--num-threads", type=int, default=1, help=">1 is faster, not bit-exact")
    return p


def _lines(paths):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if line:
                    yield line


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    from loggra_megatron.data.tokenizer import SentencePieceTokenizer, train_tokenizer

    if args.builtin_tasks is not None and args.builtin_tasks < 1:
        parser.error(f"--builtin-tasks {args.builtin_tasks}: must be >= 1")
    if args.num_threads < 1:
        parser.error(f"--num-threads {args.num_threads}: must be >= 1")
    if args.input:
        missing = [path for path in args.input if not os.path.isfile(path)]
        if missing:
            parser.error(f"--input: no such file(s): {missing}")
        texts = _lines(args.input)
    else:
        texts = task_texts(generate_tasks(args.task_kind, args.builtin_tasks, args.seed))

    start = time.perf_counter()
    try:
        model_path = train_tokenizer(
            texts,
            args.output_prefix,
            args.vocab_size,
            model_type=args.model_type,
            byte_fallback=args.byte_fallback,
            hard_vocab_limit=args.hard_vocab_limit,
            num_threads=args.num_threads,
        )
    except RuntimeError as e:  # sentencepiece's checks ("vocab_size > 0", "smaller than ...")
        reason = " ".join(str(e).split()).split("] ", 1)[-1]
        parser.error(f"--vocab-size {args.vocab_size}: sentencepiece refused it: {reason}")
    seconds = time.perf_counter() - start
    tokenizer = SentencePieceTokenizer(model_path)
    print(
        f"wrote {model_path} ({args.model_type}, vocab_size={tokenizer.vocab_size}, "
        f"requested {args.vocab_size}) in {seconds:.2f}s"
    )


if __name__ == "__main__":
    main()
