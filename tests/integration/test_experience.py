"""``rl/experience.ExperienceMaker`` directly: where each step's π_old comes from
(``RolloutEngine.old_log_probs``) and what the training batch then carries, on a tiny fp32
policy with the static engine, greedy (CPU, one process)."""

from __future__ import annotations

import pytest
import torch

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def _experiences(rank, tokenizer):
    from rl_runs import tiny_argv, tiny_policy

    from loggra_megatron.model.log_probs import compute_log_probs
    from loggra_megatron.train.build import experience_maker

    argv = tiny_argv(tokenizer, temperature=0, **{"rollout-engine": "static"})
    cfg, host, policy, examples = tiny_policy(argv)
    out = {}
    for tis, on_policy in ((False, False), (True, False), (True, True)):
        maker = experience_maker(cfg, host, policy, None, tis=tis, on_policy=on_policy)
        exp = maker.make(examples, step=0)
        out[(tis, on_policy)] = {
            "source": maker.old_log_probs,
            "batch": exp.training_batch("cpu"),
            "same_tensor": exp.old_log_probs is exp.rollout_log_probs,
            "recomputed": compute_log_probs(policy, exp.tokens, micro_batch_size=2),
        }
    return out


def test_where_pi_old_comes_from_and_what_the_batch_carries(tokenizer):
    """The static engine's sampled log-probs are π_old by default (the same tensor, no
    forward); ``--tis-cap`` over several updates recomputes the trainer's π_old beside them
    (equal to a forward of the policy, and within float noise of the engine's); on-policy
    with ``--tis-cap`` the batch has no ``old`` (the training forward's own) but keeps the
    engine's for the weights."""
    out = run_distributed(_experiences, 1, tokenizer)[0]
    plain, tis, on_policy = out[(False, False)], out[(True, False)], out[(True, True)]
    assert [plain["source"], tis["source"], on_policy["source"]] == [
        "rollout",
        "recompute",
        "training",
    ]
    assert plain["same_tensor"] and {"old", "rollout"} <= set(plain["batch"])
    mask = tis["batch"]["mask"]
    assert not tis["same_tensor"]
    recomputed = torch.where(mask, tis["recomputed"].float(), 0.0)
    torch.testing.assert_close(torch.where(mask, tis["batch"]["old"], 0.0), recomputed)
    torch.testing.assert_close(
        tis["batch"]["old"][mask], tis["batch"]["rollout"][mask], atol=1e-4, rtol=0
    )
    assert "old" not in on_policy["batch"] and "rollout" in on_policy["batch"]
