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


def _experience_with_failed_rewards(rank, tokenizer):
    from rl_runs import tiny_argv, tiny_policy

    from loggra_megatron.tasks.scoring import Scoring
    from loggra_megatron.train.build import experience_maker

    argv = tiny_argv(tokenizer, **{"rollout-engine": "static"})
    cfg, host, policy, examples = tiny_policy(argv)
    calls = []

    def fails_on_sample_0_and_the_second_group(prompt, completion, answer, metadata):
        calls.append(None)  # called in sample order, in this process
        if len(calls) - 1 in (0, 4, 5, 6, 7):
            raise ValueError("deliberate failure")
        return float(len(calls))  # sample i scores i + 1

    host.scoring = Scoring(fails_on_sample_0_and_the_second_group, None, 1.0, 0.5)
    maker = experience_maker(cfg, host, policy, None, tis=False, on_policy=False)
    exp = maker.make(examples, step=0)
    return exp.metrics, exp.advantages


def test_failed_rewards_are_counted_and_take_no_policy_gradient_step(tokenizer):
    """A sample whose reward failed is counted in reward/errors, left out of reward/mean and
    reward/accuracy, and gets advantage 0; it takes its group's mean reward, so the other
    samples of its group keep the advantages of their own rewards' mean (16 samples: 4
    prompts × 4 generations; sample 0 and the whole second group fail)."""
    metrics, advantages = run_distributed(_experience_with_failed_rewards, 1, tokenizer)[0]
    scored = [2.0, 3.0, 4.0, *range(9, 17)]
    assert metrics["reward/errors"] == 5.0 and metrics["reward/accuracy"] == 1.0
    assert metrics["reward/mean"] == pytest.approx(sum(scored) / len(scored))
    assert advantages[[0, 4, 5, 6, 7]].tolist() == [0.0] * 5
    first = advantages[1:4]  # rewards 2, 3, 4 around their mean 3 (sample 0's too)
    assert first[0] < 0 and first[1] == pytest.approx(0.0, abs=1e-6) and first[2] > 0
    assert advantages[8:].abs().sum() > 0
