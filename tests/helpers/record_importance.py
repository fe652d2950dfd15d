"""``pretrain_rl.py`` with the policy loss's inputs recorded on the training ranks, for the
hand computation of the importance weights of rollouts from an older policy.

``python tests/helpers/record_importance.py RECORD_DIR -- <pretrain_rl.py flags>`` (under
torchrun) writes ``RECORD_DIR/rank<N>.pt`` on each training rank: for every micro-batch the
clipped surrogate saw, its RL step (0-based), ``tokens``, ``mask``, π_prox (``old``: the
batch's, or the forward's own where it has none), π_behav (``rollout``: the engine's) and
the ``tis/weight_mean`` it logged."""

import atexit
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _record(record_dir: str) -> None:
    import torch

    from loggra_megatron.rl import policy_loss
    from loggra_megatron.train import trainer

    rl_step, surrogate = trainer.RLTrainer.rl_step, policy_loss.ClippedSurrogate.__call__
    current, records = {"step": -1}, []

    def recorded_rl_step(self):
        current["step"] = self.step
        return rl_step(self)

    def recorded_surrogate(self, x):
        value, metrics = surrogate(self, x)
        b = x.batch
        old = b.get("old", x.log_probs)
        fields = {"tokens": b["tokens"], "mask": x.mask, "old": old, "rollout": b["rollout"]}
        record = {k: v.detach().cpu().clone() for k, v in fields.items()}
        record.update(step=current["step"], tis=float(metrics["tis/weight_mean"]))
        records.append(record)
        return value, metrics

    def save():
        os.makedirs(record_dir, exist_ok=True)
        torch.save(records, os.path.join(record_dir, f"rank{os.environ['RANK']}.pt"))

    trainer.RLTrainer.rl_step = recorded_rl_step
    policy_loss.ClippedSurrogate.__call__ = recorded_surrogate
    atexit.register(save)


record_dir, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
generation = int(argv[argv.index("--generation-ranks") + 1])
if int(os.environ["RANK"]) < int(os.environ["WORLD_SIZE"]) - generation:
    _record(record_dir)
sys.argv = [os.path.join(ROOT, "pretrain_rl.py"), *argv]
sys.path.insert(0, ROOT)
runpy.run_path(sys.argv[0], run_name="__main__")
