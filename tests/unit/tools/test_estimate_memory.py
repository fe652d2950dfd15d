"""The memory estimator reads the same settings as ``pretrain_rl.py``: one declaration and one
default per flag (its parser is ``pretrain_rl.py``'s plus the estimate section), a launch
command's flags taken unchanged, training's derived defaults, and the same refusals by
settings (not those about this machine)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from launch_flags import (
    CONFIG_27B,
    ROOT,
    USABLE_GIB,
    env_flags,
    estimator_cli,
    exported,
    flag_list,
    names_flag,
    printed,
    read,
    script_argv,
    torchrun_flags,
)

from loggra_megatron.arguments import build_parser
from loggra_megatron.config import flag
from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.run_step import modelled_step
from loggra_megatron.train.run_config import SECTIONS

SH = os.path.join(ROOT, "examples", "h100_8gpu", "train_27b_loggra.sh")
SMALL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8"]
SMALL += ["--vocab-size", "1000", "--seq-length", "256", "--max-new-tokens", "64"]


@pytest.fixture(scope="module")
def cli():
    return estimator_cli()


def _options(parser) -> dict[str, tuple]:
    """``{option string: (dest, default, help)}`` of a parser, less ``--help``."""
    return {
        option: (a.dest, a.default, a.help)
        for option, a in parser._option_string_actions.items()
        if a.dest != "help"
    }


def test_one_declaration_per_flag(cli):
    """The estimator's flags are pretrain_rl.py's (same option strings, destinations,
    defaults and help) plus the estimate section's, and no field is in both."""
    mine, run = _options(cli.build_parser()), _options(build_parser())
    estimate = {f.name for f in dataclasses.fields(EstimateConfig)}
    assert not estimate & {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    assert {k: v for k, v in mine.items() if k in run} == run
    extra = {dest for option, (dest, *_) in mine.items() if option not in run}
    assert extra == estimate
    assert {o for o, (dest, *_) in mine.items() if dest in estimate} >= {flag(n) for n in estimate}
    # the tool declares no flag of its own: every one comes from a settings dataclass
    source = read(os.path.join(ROOT, "tools", "estimate_memory.py"))
    assert "add_argument" not in source and "add_argument_group" not in source


def test_no_copies_of_the_registries_or_rules():
    """The engines, optimizers and the chunk rule are read from their registries."""
    memory = os.path.join(ROOT, "loggra_megatron", "memory")
    paths = [os.path.join("loggra_megatron", "memory", f) for f in sorted(os.listdir(memory))]
    for path in ["tools/estimate_memory.py", "loggra_megatron/train/step_plan.py", *paths]:
        if not path.endswith(".py"):
            continue
        text = read(os.path.join(ROOT, path))
        assert not re.search(r"ROLLOUT_ENGINES\s*=|OPTIMIZERS\s*=|== \"(dynamic|static)\"", text)


def test_the_27b_launch_command_is_taken_unchanged(cli, capsys):
    """Every flag of the script's pretrain_rl.py line, the memory-neutral ones too, and the
    documented numbers (docs/memory.md, the script's header)."""
    flags = set(cli.build_parser()._option_string_actions)
    whole = [x for f, values in torchrun_flags(SH) for x in (f, *values)]
    env = env_flags(exported(read(SH)))
    argv = ["--hf-config", CONFIG_27B, "--world-size", "8", "--gpu-memory-gb", str(USABLE_GIB)]
    out = printed(cli, capsys, [*argv, *env, *whole])
    assert out == printed(cli, capsys, script_argv(SH, 8, flags))
    assert {"--load", "--tokenizer-model", "--lr"} <= {f for f, _ in flag_list(whole)}
    total = next(line for line in out.splitlines() if line.startswith("TOTAL per GPU"))
    assert total.split()[3:5] == ["83.60", "41.97"]  # dense Adam, LoGRA's backward sketch


def test_loggra_rank_defaults_to_hidden_over_8_as_in_training(cli):
    _, cfg, est = cli.parse([*SMALL])
    assert modelled_step(cfg, est)[1].loggra_rank == 256 // 8 == cfg.loggra.loggra_rank
    _, cfg, est = cli.parse([*SMALL, "--loggra-rank", "4"])
    assert modelled_step(cfg, est)[1].loggra_rank == 4
    _, cfg, est = cli.parse(["--hf-config", CONFIG_27B, "--tensor-model-parallel-size", "8"])
    assert modelled_step(cfg, est)[1].loggra_rank == 5120 // 8


@pytest.mark.parametrize(
    "extra,name",
    [
        (["--sequence-parallel"], "--sequence-parallel"),  # TP 1
        (["--fp8-format", "hybrid"], "--fp8-format"),  # without --bf16
        (["--optimizer", "adam", "--loggra-rank", "8"], "--loggra-rank"),  # does not apply
        (["--global-batch-size", "5"], "--global-batch-size"),  # 16 rollouts
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb"),  # the estimate section's own
        (["--runtime-overhead-gb", "-1"], "--runtime-overhead-gb"),
        (["--exp-avg-dtype", "fp8"], "--exp-avg-dtype"),
    ],
)
def test_what_pretrain_rl_refuses_by_settings_exits_2(cli, capsys, extra, name):
    with pytest.raises(SystemExit) as e:
        cli.main([*SMALL, *extra])
    assert e.value.code == 2 and names_flag(capsys.readouterr().err, name)


@pytest.mark.parametrize(
    "extra",
    [
        ["--device", "cuda", "--bf16"],
        ["--transformer-impl", "transformer_engine", "--bf16"],
        [
            "--bf16",
            "--fp8-format",
            "hybrid",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        ["--tokenizer-model", "/no/such/tokenizer", "--task", "jsonl", "--data-path", "/no.jsonl"],
    ],
)
def test_what_only_the_machine_can_tell_is_not_refused(cli, capsys, extra):
    """No CUDA device or Transformer Engine here, and no tokenizer or data file: the run's
    GPU has them, and the estimator reads no file but --hf-config."""
    assert not torch.cuda.is_available()
    assert cli.main([*SMALL, *extra]) == 0
    capsys.readouterr()
