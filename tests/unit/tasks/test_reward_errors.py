"""Reward errors in the trainer's process: a failing reward is counted, never a wrong answer;
too many failures stop the run naming a sample; what an error quotes is clipped; the reward
settings are checked at parse time; built-in rewards stay bounded on adversarial text."""

import time

import pytest
from rl_runs import REWARD, refused, tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.tasks import TASKS
from loggra_megatron.tasks.rewards import BUILTIN_REWARDS, last_number_reward
from loggra_megatron.tasks.scoring import RewardFunctionError, Scoring


def _fails_on_bad(prompt, completion, answer, metadata):
    if prompt == "bad":
        raise ZeroDivisionError("deliberate failure")
    return 1.0


def test_a_failing_reward_is_counted_not_scored_as_a_wrong_answer():
    """It used to stop the run at once, or (math-verify) read as reward 0, a wrong answer."""
    scoring = Scoring(_fails_on_bad, None, 1.0, max_error_fraction=0.5)
    scores = scoring.score(["ok", "bad", "ok", "ok"], ["c"] * 4, ["1"] * 4)
    assert scores.failed == [False, True, False, False]
    assert scores.correct == [True, False, True, True] and scores.totals() == (3.0, 3, 3)
    (error,) = scores.errors
    assert error.index == 1 and "raised on sample 1" in error.headline
    assert "ZeroDivisionError: deliberate failure" in error.traceback_text


def test_more_failures_than_the_fraction_allows_stop_the_run_naming_the_first():
    scoring = Scoring(_fails_on_bad, None, 1.0, max_error_fraction=0.5)
    with pytest.raises(RewardFunctionError) as e:
        scoring.score(["ok", "bad", "bad", "bad"], ["c"] * 4, ["1"] * 4)
    assert e.value.index == 1
    assert (
        "raised on sample 1 (prompt: 'bad'); 3 of the batch's 4 rewards failed, more than "
        "--reward-max-error-fraction 0.5 allows (2): fix the reward function"
    ) in str(e.value).splitlines()[0]
    located = e.value.at(" at RL step 2 (dataset prompt index 7)")
    assert "sample 1 at RL step 2 (dataset prompt index 7)" in str(located)
    assert "3 of the batch's 4 rewards failed" in str(located)


HUGE = "z" * 5_000_000


@pytest.mark.parametrize(
    "reward",
    [
        lambda p, c, a, m: {"reward": HUGE},
        lambda p, c, a, m: {"score": HUGE},
        lambda p, c, a, m: {"reward": 1.0, "correct": HUGE},
        lambda p, c, a, m: HUGE,
        lambda p, c, a, m: (_ for _ in ()).throw(ValueError(HUGE)),
        last_number_reward,  # its reference answer is not a number
    ],
)
def test_reward_errors_clip_the_samples_and_values_they_quote(reward):
    """A dict reward carrying a 5 MB string made a 5 MB error message."""
    with pytest.raises(RewardFunctionError) as e:
        Scoring(reward, None, 1.0).score([HUGE], [HUGE], [HUGE])
    message = str(e.value)
    assert len(message) < 6000 and "characters)" in message, message[:500]
    assert "(5000002 characters)" in e.value.headline  # the prompt's repr, clipped


def test_the_reward_settings_are_checked_at_parse_time(tokenizer, capsys):
    """--reward-timeout 1e30 crashed at RL step 1 (a wait's timeout overflowed)."""
    refused(
        tiny_argv(tokenizer, **{"reward-timeout": 1e30}),
        capsys,
        "--reward-timeout=1e+30: must be in [0, 604800] seconds (at most 7 days",
    )
    cfg = parse_args(tiny_argv(tokenizer, **{"reward-timeout": 604800}), world_size=2)
    assert cfg.data.reward_timeout == 604800
    refused(
        tiny_argv(tokenizer, **{"reward-max-error-fraction": 1.0}),
        capsys,
        "--reward-max-error-fraction=1.0: must be in [0, 1)",
    )
    refused(tiny_argv(tokenizer, **{"reward-workers": 0}), capsys, "--reward-workers=0")
    for builtin in (None, "last_number"):  # in the trainer's process: no worker, no limit
        for flag, value in (("reward-timeout", 5), ("reward-workers", 3)):
            refused(
                tiny_argv(tokenizer, **{"reward-fn": builtin, flag: value}),
                capsys,
                f"--{flag}={value}",
                "applies with a --reward-fn module:function only",
            )


def test_preflight_runs_a_user_function_in_workers_and_the_builtins_here():
    from loggra_megatron.data.config import DataConfig
    from loggra_megatron.train.preflight import _scoring

    task = TASKS["arithmetic"]()
    assert _scoring(DataConfig(), task).workers is None
    assert _scoring(DataConfig(reward_fn="last_number"), task).workers is None
    spec = f"{REWARD}:digit_count"
    scoring = _scoring(DataConfig(reward_fn=spec, reward_timeout=3, reward_workers=4), task)
    workers = scoring.workers
    assert (workers.spec, workers.processes, workers.timeout) == (spec, 4, 3.0)
    assert not workers.alive and scoring.name == spec  # started at the first batch
    assert scoring.max_error_fraction == DataConfig().reward_max_error_fraction == 0.5


ADVERSARIAL = {
    "digits": "1" * 100_000,
    "thousands groups": "1,000" * 20_000,
    "minus signs": "-" * 100_000,
    "markers": "#### " * 20_000,
    "open boxes": "\\boxed{" * 14_000,
    "nested boxes": "\\boxed{" * 7_000 + "}" * 7_000,
    "numbers": "-1,000.5x" * 11_000,
}
"""Completions of 100,000 characters or so built to make the built-in parsers backtrack."""


@pytest.mark.parametrize(
    "reward",
    [*BUILTIN_REWARDS.values(), *(TASKS[name]().reward for name in sorted(TASKS))],
    ids=[*BUILTIN_REWARDS, *sorted(TASKS)],
)
def test_the_builtin_rewards_are_bounded_on_adversarial_text(reward):
    """Why the built-ins run in the trainer's process without a time limit: linear-time
    parsing (each takes well under 0.1 s here; math-verify parses at most 1000 characters,
    within its own 2 s limits)."""
    for text in ADVERSARIAL.values():
        start = time.perf_counter()
        reward("q", text, "7", {})
        assert time.perf_counter() - start < 2.0
