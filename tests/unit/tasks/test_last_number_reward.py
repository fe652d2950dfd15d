"""The ``last_number`` built-in reward: how it reads a final answer written in free text."""

import pytest

from loggra_megatron.tasks.rewards import (
    BUILTIN_REWARDS,
    boxed_contents,
    final_number,
    last_number_reward,
    load_reward_fn,
)
from loggra_megatron.tasks.scoring import RewardFunctionError, Scoring


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        # the last number of free text
        ("3 + 4 = 7", "7", 1.0),
        ("3 + 4 = 7\n\nThis is a classic example of addition.", "7", 1.0),
        ("The answer is 7.", "7", 1.0),
        ("7", "7", 1.0),
        ("3 + 4 = 8", "7", 0.0),
        ("Adding 3 and 4 gives 7, and 7 + 1 = 8", "7", 0.0),  # the last number, not the first
        # commas: thousands groups of exactly three digits
        ("The total is 1,000, so", "1000", 1.0),
        ("It costs $1,234.50.", "1234.5", 1.0),
        ("I count 1, 2, 3", "3", 1.0),
        ("1000", "1,000", 1.0),
        # negative numbers: a minus sign unless it follows a letter, digit or bracket
        ("So x = -12.", "-12", 1.0),
        ("So x = -12.", "12", 0.0),
        ("5 - 3 = 2", "2", 1.0),
        ("7-2", "2", 1.0),
        ("x-1", "1", 1.0),
        ("(3)-4", "4", 1.0),
        # decimals
        ("half is 0.5", "0.5", 1.0),
        ("half is .5", "0.5", 1.0),
        ("3.50", "3.5", 1.0),
        ("3.7", "3.75", 0.0),
        ("0.1 + 0.2 = 0.30000000000000004", "0.3", 1.0),
        # a boxed answer is final, before any later number
        ("So \\boxed{7}. Check: 7 + 1 = 8", "7", 1.0),
        ("\\boxed{5} first, then \\boxed{7}; 9 apples", "7", 1.0),  # the last boxed
        ("#### 8\nso \\boxed{7}", "7", 1.0),  # boxed before ####
        ("\\boxed{ $-2$ } and 5", "-2", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\frac{1}{2}} = 0.5", "0.5", 0.0),  # not a plain number: no other is read
        ("\\boxed{x = 7}", "7", 0.0),
        ("\\boxed{7", "7", 1.0),  # left open (truncated): the last number
        ("\\boxed{5} and \\boxed{7", "5", 1.0),  # the last boxed that closes
        # the number after the first ####, before the last number
        ("#### 7\nThen 7 + 1 = 8", "7", 1.0),
        ("#### 7 then #### 8", "7", 1.0),
        ("####: none, 12", "12", 1.0),  # a marker without a number is no answer
        # no number
        ("I do not know.", "7", 0.0),
        ("", "7", 0.0),
        ("\\boxed{}", "0", 0.0),
    ],
)
def test_last_number_reward(completion, answer, expected):
    assert last_number_reward("q", completion, answer, {}) == expected


def test_final_number_and_boxed_contents():
    assert final_number("3 + 4 = 7\nDone") == "7"
    assert final_number("nothing") is None
    assert final_number("\\boxed{\\frac{1}{2}}") is None
    assert boxed_contents("a \\boxed{\\frac{1}{2}} b \\boxed{3}") == ["\\frac{1}{2}", "3"]
    assert boxed_contents("\\boxed{\\boxed{3}}") == ["\\boxed{3}"]  # nested: the outer one
    assert boxed_contents("\\boxed{3} \\boxed{4") == ["3"]
    assert boxed_contents("no box") == []


def test_last_number_is_a_builtin_and_counts_correct_at_reward_one():
    assert load_reward_fn("last_number") is last_number_reward
    assert BUILTIN_REWARDS["last_number"] is last_number_reward
    scores = Scoring(last_number_reward, None, 1.0).score(
        ["What is 3 + 4?"] * 3,
        ["3 + 4 = 7", "It is 8", "\\boxed{7}"],
        ["7", "7", "7"],
    )
    assert scores.rewards == [1.0, 0.0, 1.0] and scores.correct == [True, False, True]


def test_a_reference_answer_that_is_not_a_number_stops_the_run():
    with pytest.raises(RewardFunctionError, match="raised on sample 0") as e:
        Scoring(last_number_reward, None, 1.0).score(["q"], ["7"], ["seven"])
    assert "reference answer 'seven' is not a number" in str(e.value)
