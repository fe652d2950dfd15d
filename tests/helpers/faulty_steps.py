"""``pretrain_rl.py`` with two faulty optimizer steps on the training ranks, for the tests of
the weight sync across steps that change no weight:

* RL step 1 (0-based) has non-finite gradients (the KL penalty's β set to inf for that step,
  as ``tests/integration/test_skipped_steps.py`` does in process): the update is skipped;
* RL step 2's first predicted-KL trial measures a non-finite KL: the update is rejected
  (``PredictedKLController._reject``).

Run it with torchrun in place of ``pretrain_rl.py``; the generation ranks (the last
``--generation-ranks`` of the world) run unchanged."""

import math
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NONFINITE_GRADS_STEP, NONFINITE_KL_STEP = 1, 2


def _fault_the_training_ranks() -> None:
    from loggra_megatron.rl import kl_control
    from loggra_megatron.train import trainer

    rl_step, trial = trainer.RLTrainer.rl_step, kl_control.PredictedKLController._trial
    current = {"step": -1}

    def faulty_rl_step(self):
        current["step"] = self.step
        if self.step != NONFINITE_GRADS_STEP:
            return rl_step(self)
        beta, self.kl_coef.value = self.kl_coef.value, math.inf
        try:
            return rl_step(self)
        finally:
            self.kl_coef.value = beta

    def faulty_trial(self, u, eta):
        if current["step"] == NONFINITE_KL_STEP:
            return math.nan, None, 0
        return trial(self, u, eta)

    trainer.RLTrainer.rl_step = faulty_rl_step
    kl_control.PredictedKLController._trial = faulty_trial


generation = int(sys.argv[sys.argv.index("--generation-ranks") + 1])
if int(os.environ["RANK"]) < int(os.environ["WORLD_SIZE"]) - generation:
    _fault_the_training_ranks()
sys.argv = [os.path.join(ROOT, "pretrain_rl.py"), *sys.argv[1:]]
sys.path.insert(0, ROOT)
runpy.run_path(sys.argv[0], run_name="__main__")
