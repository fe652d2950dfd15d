"""``python -m loggra_megatron.tasks --kind mixed --n 1000 --seed 0 --output tasks.jsonl``:
write built-in task examples as a ``--data-path`` JSONL file."""

import argparse

from loggra_megatron.tasks import TASKS, generate_tasks, write_jsonl

parser = argparse.ArgumentParser(
    allow_abbrev=False, description="Write generated tasks as JSONL (--data-path)."
)
parser.add_argument("--kind", choices=list(TASKS), default="mixed")
parser.add_argument("--n", type=int, required=True)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--output", required=True)
args = parser.parse_args()
write_jsonl(generate_tasks(args.kind, args.n, args.seed), args.output)
