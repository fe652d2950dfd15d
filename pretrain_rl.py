"""GRPO/PPO training of a Megatron-Core policy with LoGRA and predicted-KL step control.

    torchrun --nproc-per-node 2 pretrain_rl.py --tokenizer-model tok.model --bf16 \
        --optimizer loggra --loggra-rank 16 --kl-target 0.01 --save runs/grpo ...

Parse (every flag validated before any process group is created) → build → train.
See README.md and `python pretrain_rl.py --help`.
"""

import os
import sys

from loggra_megatron.library_notes import quiet_benign_warnings

quiet_benign_warnings()  # before Megatron-Core is imported: it warns on import

from loggra_megatron.arguments import parse_args  # noqa: E402
from loggra_megatron.checkpointing.layout import resume_note  # noqa: E402
from loggra_megatron.checkpointing.run_lock import claim_run_directories  # noqa: E402
from loggra_megatron.config import ConfigError  # noqa: E402
from loggra_megatron.memory.kv_budget import kv_budget  # noqa: E402
from loggra_megatron.metrics import MetricsWriteError  # noqa: E402
from loggra_megatron.placement import Placement, Role, start_placement  # noqa: E402
from loggra_megatron.placement.channel import GenerationStopped  # noqa: E402
from loggra_megatron.train.generation_worker import GenerationWorker  # noqa: E402
from loggra_megatron.train.preflight import preflight  # noqa: E402
from loggra_megatron.train.trainer import RLTrainer, TrainingStopped  # noqa: E402


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str, status: int) -> None:
    if _rank() == 0:
        print(f"pretrain_rl.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def main(argv=None) -> None:
    cfg = parse_args(argv)  # exit 2 on a bad flag
    try:
        host = preflight(cfg)  # tokenizer, reward, data, resume checks: still no process group
        # rank 0 holds the run lock of --save and the output directory until the run ends
        locks = []
        if _rank() == 0:
            locks = claim_run_directories(cfg.checkpoint, cfg.logging, cfg.start.seen, host.notes)
    except ConfigError as e:
        _fail(str(e), 2)
    placement = Placement.of(cfg.placement.generation_ranks)
    channel = None
    if cfg.placement.disaggregated:  # each role's own world, and the leaders' channel
        timeout_s = 60 * cfg.placement.generation_timeout_minutes
        channel = start_placement(placement, cfg.parallel.uses_cuda(cuda_visible()), timeout_s)
    if placement.role is Role.GENERATION:
        try:
            GenerationWorker(cfg, host, channel, size_kv_budget=kv_budget).setup().serve()
        except GenerationStopped as e:
            print(f"pretrain_rl.py: {placement.name}: error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
        return
    try:
        sizing = None if cfg.placement.disaggregated else kv_budget  # no KV cache here
        RLTrainer(cfg, host, size_kv_budget=sizing, channel=channel).setup().train()
    except (TrainingStopped, GenerationStopped) as e:  # on every rank alike; checkpoints untouched
        _fail(str(e), 1)
    except MetricsWriteError as e:  # rank 0 alone: torchrun then stops the other ranks
        _fail(f"{e}; {resume_note(cfg.checkpoint.save)}", 1)
    for lock in locks:
        lock.release()


if __name__ == "__main__":
    main()
