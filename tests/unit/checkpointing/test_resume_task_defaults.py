"""A task's knob defaults are its ``FLAGS`` defaults: a checkpoint of an older run that
recorded a task flag as None (the knob's default applied) resumes as the same data, while a
changed value is still refused."""

import pytest
from rl_runs import tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.checkpointing.resume import _check_state_settings, _with_task_defaults
from loggra_megatron.config import ConfigError
from loggra_megatron.tasks.arithmetic import ArithmeticFlags, ArithmeticTask


def test_knob_defaults_come_from_the_flags():
    flags = ArithmeticFlags()
    assert ArithmeticTask.KNOBS["num_digits"] == flags.task_digits == 2
    assert ArithmeticTask().knobs["operators"] == flags.task_operators == "+-*"


def test_a_checkpoint_that_recorded_none_resumes_and_a_change_is_refused(tokenizer):
    now = parse_args(tiny_argv(tokenizer), world_size=2).flags()
    older = {**now, "task_digits": None, "task_operators": None}
    with pytest.raises(ConfigError, match="--task-digits"):
        _check_state_settings(now, older)  # compared as recorded: refused
    _check_state_settings(now, _with_task_defaults(older))  # the same data: resumes
    changed = _with_task_defaults({**older, "task_digits": 3})
    with pytest.raises(ConfigError, match="--task-digits: the checkpoint was saved with"):
        _check_state_settings(now, changed)
