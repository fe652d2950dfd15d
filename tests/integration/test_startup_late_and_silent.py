"""Mistakes that used to pass start-up and fail late or never: each is
refused or warned about before any process group (exit 2, the flag named)."""

import os
import subprocess
import sys

import pytest
from rl_runs import REWARD, ROOT, refused, tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.tasks.scoring import RewardFunctionError, Scoring


def test_a_reward_function_with_the_wrong_signature_is_refused(tokenizer, tmp_path):
    """It passed start-up and crashed at RL step 1; the host-side preflight refuses it."""
    argv = tiny_argv(tokenizer, **{"reward-fn": f"{REWARD}:two_args", "output-dir": tmp_path})
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot be called as two_args(prompt, completion, answer, metadata)" in r.stderr


def test_greedy_grpo_groups_are_warned_about(tokenizer):
    cfg = parse_args(tiny_argv(tokenizer, temperature=0), world_size=2)
    assert any("--temperature 0" in note and "advantage is 0" in note for note in cfg.start.notes)
    cfg = parse_args(tiny_argv(tokenizer), world_size=2)
    assert not any("--temperature 0" in note for note in cfg.start.notes)


def test_a_reward_beyond_float32_names_its_sample():
    with pytest.raises(RewardFunctionError, match=r"returned 1e\+300, beyond float32's range"):
        Scoring(lambda p, c, a, m: 1e300 if p == "b" else 0.0, None, 1.0).score(
            ["a", "b"], ["c"] * 2, ["1"] * 2
        )
    for huge in (-1e39, 10**400):  # an int beyond every float raised OverflowError
        with pytest.raises(RewardFunctionError, match="beyond float32's range") as e:
            Scoring(lambda p, c, a, m, huge=huge: huge, None, 1.0).score(["a"], ["c"], ["1"])
        assert e.value.index == 0


def test_a_config_file_key_given_twice_is_refused(tokenizer, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("lr: 1e-4\ntrain-iters: 3\nlr: 2e-4\n")
    refused(
        [*tiny_argv(tokenizer), "--config", str(config)],
        capsys,
        "--config",
        "gives 'lr' twice (lines 1 and 3)",
    )


def test_a_renamed_flag_names_its_new_name(tokenizer, capsys):
    refused(
        [*tiny_argv(tokenizer), "--kl-coef-target", "0.1"],
        capsys,
        "--kl-coef-target was renamed --kl-ref-target",
    )


def test_flag_prefixes_are_not_accepted(tokenizer, capsys):
    """``--save-int`` used to bind to ``--save-interval``; a prefix can silently bind to a
    flag added later."""
    refused(
        [*tiny_argv(tokenizer), "--save-int", "3"], capsys, "unrecognized arguments: --save-int"
    )
    for tool, argv in (
        (
            "convert_checkpoint.py",
            ["--direction", "hf-to-megatron", "--load", "x", "--save", "y", "--tensor", "2"],
        ),
        ("train_tokenizer.py", ["--builtin-tasks", "10", "--output-prefix", "x", "--vocab", "9"]),
        ("estimate_memory.py", ["--hidden", "64"]),
    ):
        r = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", tool), *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "unrecognized arguments" in r.stderr, (tool, r.stderr)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--builtin-tasks", "100", "--vocab-size", "0"], "--vocab-size 0: sentencepiece refused"),
        (["--builtin-tasks", "-5"], "--builtin-tasks -5: must be >= 1"),
        (["--builtin-tasks", "100", "--vocab-size", "50"], "smaller than required_chars"),
    ],
)
def test_the_tokenizer_tool_refuses_bad_input_in_one_line(tmp_path, argv, needle):
    """The same class of defect in the other tools: these were
    sentencepiece or generator tracebacks."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), *argv]
        + ["--output-prefix", str(tmp_path / "tok")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_plot_metrics_of_a_run_without_metrics_is_one_line(tmp_path):
    """A directory without metrics.jsonl was a FileNotFoundError traceback."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "No such file" in r.stderr and "Traceback" not in r.stderr
