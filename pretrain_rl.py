"""GRPO/PPO training of a Megatron-Core policy with LoGRA and predicted-KL step control.

    torchrun --nproc-per-node 2 pretrain_rl.py --tokenizer-model tok.model --bf16 \
        --optimizer loggra --loggra-rank 16 --kl-target 0.01 --save runs/grpo ...

Parse (every flag validated before any process group is created) → build → train.
See README.md and `python pretrain_rl.py --help`.
"""

import sys

from loggra_megatron.arguments import parse_args
from loggra_megatron.trainer import RLTrainer, TrainingStopped


def main(argv=None) -> None:
    cfg = parse_args(argv)
    trainer = RLTrainer(cfg)
    try:
        trainer.setup().train()
    except TrainingStopped as e:  # raised on every rank alike
        if getattr(trainer, "rank", 0) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
