"""Start-up checks of ``pretrain_rl.py`` (exit status 2, the flag named, before any process
group): settings that would do nothing, and settings that used to crash after the process
group started."""

import dataclasses

import pytest
from rl_runs import tiny_argv

from loggra_megatron.arguments import SECTIONS, parse_args
from loggra_megatron.config import flag

BASES = [
    {},  # LoGRA, no reference model, no KL control, a generated task, a --reward-fn
    {"optimizer": "adam"},
    {"reward-fn": None},
    {"data-path": "DATA", "reward-fn": None},
    {"no-use-distributed-optimizer": True},
    {"loggra-projection": "svd"},
    {"loggra-projection": "identity"},
    {"temperature": 0},
]
"""Configurations under which the declared conditions fail (each flag is tried in the first
base where its own condition is false)."""
CHOICES = {
    "loggra_projection": "random",
    "kl_estimator": "k3",
    "kl_ref_estimator": "k1",
    "recompute_method": "uniform",
    "fp8_recipe": "tensorwise",
    "task_operators": "+",
    "prompt_key": "question",
    "answer_key": "solution",
    "wandb_run_name": "name",
    "eval_data_path": "DATA",
    "top_p": 0.5,
}
"""A valid value other than the default, for the declared fields of type ``str`` and those
where the generic one (the opposite boolean, 1 for None, twice the default, 1 or 0.5 for 0) is
not valid."""


def _declared():
    """``(field, rule)`` of every setting that declares when it applies."""
    return [
        (f, f.metadata["applies"])
        for cls in SECTIONS.values()
        for f in dataclasses.fields(cls)
        if "applies" in f.metadata
    ]


def _other_value(f):
    """A valid value of field ``f`` that is not its default."""
    if f.name in CHOICES:
        return CHOICES[f.name]
    if f.default is None or f.default is False or f.default is True:
        return {None: 1, False: True, True: False}[f.default]
    return f.default * 2 or (1 if isinstance(f.default, int) else 0.5)


def _argv(tokenizer, data, flags: dict) -> list[str]:
    flags = {k: (data if v == "DATA" else v) for k, v in flags.items()}
    return tiny_argv(tokenizer, **flags)


def _with(argv: list[str], name: str, value) -> list[str]:
    if value is True or value is False:
        return [*argv, flag(name) if value else "--no-" + name.replace("_", "-")]
    return [*argv, flag(name), str(value)]


def test_every_setting_that_does_not_apply_is_refused(tokenizer, tmp_path, capsys):
    """Derived from the settings' own declarations, over every flag that has one: given with
    a value of its own while its condition fails, the flag exits 2 naming itself and the
    condition (it used to be accepted and silently ignored)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "1"}\n')
    declared = _declared()
    names = {f.name for f, _ in declared}
    for expected in (
        "kl_coef_target",
        "kl_probe_fraction",
        "eval_data_path",
        "loggra_rank",
        "sft_lr",
        "task_digits",
        "format_reward",
        "wandb_run_name",
        "top_p",
    ):
        assert expected in names, expected
    for f, rule in declared:
        value = _other_value(f)
        value = str(data) if value == "DATA" else value
        for base in BASES:
            settings = parse_args(_argv(tokenizer, data, base)).flags()
            if not rule.holds({**settings, f.name: value}):
                break
        else:
            raise AssertionError(f"no base configuration turns {flag(f.name)} off")
        with pytest.raises(SystemExit) as refused:
            parse_args(_with(_argv(tokenizer, data, base), f.name, value))
        err = capsys.readouterr().err
        assert refused.value.code == 2 and f"{flag(f.name)}=" in err, (f.name, err)
        assert f"applies {rule.when} only" in err, (f.name, err)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            {
                "recompute-granularity": "full",
                "recompute-method": "uniform",
                "recompute-num-layers": 3,
            },
            "--recompute-num-layers: 3 is more than the 2 layers",
        ),
        ({"lr": 1e300}, "--lr=1e+300: must be a finite number of float32's range"),
        ({"sft-iters": 1, "sft-lr": 1e39}, "--sft-lr=1e+39"),
        ({"seed": 2**63}, "--seed=9223372036854775808: must be in [0, 2^63)"),
        ({"loggra-seed": 2**63}, "--loggra-seed=9223372036854775808: must be in [0, 2^63)"),
    ],
)
def test_settings_that_crashed_after_the_process_group_started_exit_2(
    tokenizer, overrides, needle, capsys
):
    with pytest.raises(SystemExit) as refused:
        parse_args(tiny_argv(tokenizer, **overrides))
    err = capsys.readouterr().err
    assert refused.value.code == 2 and needle in err, err


def test_the_largest_seed_trains(tokenizer):
    """Seeds up to 2^63 - 1 work: LoGRA's per-weight seeds used to overflow int64."""
    import torch

    from loggra_megatron.optim import LoGRAAdamW

    cfg = parse_args(tiny_argv(tokenizer, seed=2**63 - 1))
    assert cfg.loggra.loggra_seed == 2**63 - 1
    weight = torch.nn.Parameter(torch.randn(16, 12))
    opt = LoGRAAdamW(
        [weight], lr=1e-2, rank=4, update_interval=1, min_dim=4, seed=cfg.loggra.loggra_seed
    )
    for _ in range(2):
        weight.grad = torch.randn_like(weight)
        opt.step()
    assert torch.isfinite(weight).all() and opt.state[weight]["basis"].shape == (12, 4)
