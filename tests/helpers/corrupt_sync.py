"""``pretrain_rl.py`` with the generation ranks' first low-rank weight sync corrupted: one bit
of one sketched weight flipped after the row updates are applied (``Shadows.advance``), for
the tests of ``--weight-sync-on-mismatch``. Run it with torchrun in place of
``pretrain_rl.py``; the generation ranks are the last ``--generation-ranks`` of the world."""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _corrupt_the_first_lowrank_sync() -> None:
    import torch

    from loggra_megatron.placement import lowrank

    advance, done = lowrank.Shadows.advance, []

    def corrupted(self, updates):
        out = advance(self, updates)
        if not done:
            weight = next(iter(self.shadows.values())).weight
            weight.view(-1)[:1].view(torch.int16).bitwise_xor_(1)  # bf16: the last bit
            done.append(True)
        return out

    lowrank.Shadows.advance = corrupted


generation = int(sys.argv[sys.argv.index("--generation-ranks") + 1])
if int(os.environ["RANK"]) >= int(os.environ["WORLD_SIZE"]) - generation:
    _corrupt_the_first_lowrank_sync()
sys.argv = [os.path.join(ROOT, "pretrain_rl.py"), *sys.argv[1:]]
sys.path.insert(0, ROOT)
runpy.run_path(sys.argv[0], run_name="__main__")
