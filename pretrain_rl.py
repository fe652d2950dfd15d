"""GRPO/PPO training of a Megatron-Core policy with LoGRA and predicted-KL step control.

    torchrun --nproc-per-node 2 pretrain_rl.py --tokenizer-model tok.model --bf16 \
        --optimizer loggra --loggra-rank 16 --kl-target 0.01 --save runs/grpo ...

Parse (every flag validated before any process group is created) → build → train.
See README.md and `python pretrain_rl.py --help`.
"""

from loggra_megatron.arguments import parse_args
from loggra_megatron.trainer import RLTrainer


def main(argv=None) -> None:
    cfg = parse_args(argv)
    RLTrainer(cfg).setup().train()


if __name__ == "__main__":
    main()
