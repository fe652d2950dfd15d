"""Start-up checks of ``pretrain_rl.py`` (exit status 2, the flag or file named, before any
process group): settings that would do nothing, settings that used to crash after the
process group started, and inputs that used to end in a traceback."""

import dataclasses
import json

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
    {"rollout-engine": "static"},  # no old-log-prob recompute
    {"advantage-estimator": "reinforce-baseline"},  # no group-relative advantages
]
"""Configurations under which the declared conditions fail (each flag is tried in the first
base where its own condition is false)."""
CHOICES = {
    "loggra_projection": "random",
    "weight_sync": "lowrank",
    "weight_sync_on_mismatch": "resync",
    "loggra_sketch": "gradient",
    "loggra_targets": "linear_qkv",
    "loggra_sketch_matrix": "gaussian",
    "loggra_row_optimizer": "sgd",
    "loggra_sketch_reduce": "microbatch",
    "loggra_row_beta2": 0.9,
    "sft_optimizer": "loggra",
    "kl_estimator": "k3",
    "kl_ref_estimator": "k1",
    "baseline_decay": 0.5,
    "recompute_method": "uniform",
    "fp8_recipe": "delayed",
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


def test_log_prob_micro_batch_size_sizes_the_dynamic_engines_recompute(tokenizer, tmp_path):
    """Without a reference model or KL control the old-log-prob recompute of an engine that
    has one (auto may pick it on a GPU) still reads --log-prob-micro-batch-size; only the
    static engine, which samples the log-probs while decoding, makes it do nothing."""
    auto = _argv(tokenizer, tmp_path, {"rollout-engine": "auto"})
    assert (
        parse_args(_with(auto, "log_prob_micro_batch_size", 2)).training.forward_micro_batch_size
        == 2
    )
    rule = next(r for f, r in _declared() if f.name == "log_prob_micro_batch_size")
    assert rule.holds({"kl_coef": 0.0, "kl_target": None, "rollout_engine": "dynamic"})
    static = _argv(tokenizer, tmp_path, {"rollout-engine": "static"})
    with pytest.raises(SystemExit):
        parse_args(_with(static, "log_prob_micro_batch_size", 2))


def test_every_setting_that_does_not_apply_is_refused(tokenizer, tmp_path, capsys):
    """Derived from the settings' own declarations, over every flag that has one: given with
    a value of its own while its condition fails, the flag exits 2 naming itself and the
    condition (it used to be accepted and silently ignored)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "1"}\n')
    declared = _declared()
    names = {f.name for f, _ in declared}
    for expected in (
        "kl_ref_target",
        "kl_probe_fraction",
        "eval_data_path",
        "loggra_rank",
        "sft_lr",
        "task_digits",
        "format_reward",
        "wandb_run_name",
        "top_p",
        "inference_dynamic_batching_num_cuda_graphs",
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


# ---------------------------------------------------------------- inputs that raised
def _hf_tokenizer(path, chat_template=None, generation_config=None):
    """A small byte-level BPE tokenizer directory (as examples/hf_model makes one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["What is 1 + 1?", "#### 2"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", chat_template=chat_template
    )
    fast.save_pretrained(path)
    if generation_config is not None:
        (path / "generation_config.json").write_text(generation_config)
    return path


CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}"
)


def _case(name, tmp_path, tokenizer):
    """The flags and files of one start-up problem, and what its message must say."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": [{"role": "system", "content": "Be brief."}], "answer": "2"}\n')
    bad_py = tmp_path / "bad_reward.py"
    if name == "config-yaml":
        (tmp_path / "run.yaml").write_text("lr: [0.1,\nseed: 3\n")
        needles = ["--config", f"{tmp_path / 'run.yaml'}:3: is not valid YAML"]
        return ["--config", str(tmp_path / "run.yaml")], needles
    if name == "reward-syntax":
        bad_py.write_text("def score(p, c, a, m):\n    return 1 +\n")
        return {"reward-fn": f"{bad_py}:score"}, ["--reward-fn", f"{bad_py}:2: syntax error"]
    if name == "reward-exits-on-import":
        bad_py.write_text("import sys\nsys.exit(3)\n")
        return {"reward-fn": f"{bad_py}:score"}, ["--reward-fn", "called sys.exit(3)"]
    if name == "reward-raises-on-import":
        bad_py.write_text("x = 1\nraise RuntimeError('no GPU here')\n")
        return {"reward-fn": f"{bad_py}:score"}, ["RuntimeError: no GPU here", f"{bad_py}:2"]
    if name == "generation-config":
        hf = _hf_tokenizer(tmp_path / "hf", CHAT, generation_config="{garbled")
        return {"tokenizer-model": hf}, ["--tokenizer-model", "generation_config.json"]
    if name == "subdirectory":
        shards = tmp_path / "shards"
        (shards / "part-1.jsonl").mkdir(parents=True)
        return {"data-path": shards, "reward-fn": None}, ["--data-path", "is a directory"]
    if name == "template-raises":
        hf = _hf_tokenizer(tmp_path / "hf", "{{ messages[5]['content'] | undefined_filter }}")
        return {"tokenizer-model": hf, "data-path": data}, [f"{data}:1: rendering the prompt"]
    if name == "template-refuses-system":
        hf = _hf_tokenizer(tmp_path / "hf", NO_SYSTEM)
        flags = {"tokenizer-model": hf, "data-path": data, "system-prompt": "Be brief."}
        return flags, [f"{data}:1:", "System role not supported", "take a system turn?"]
    if name == "empty-template":
        hf = _hf_tokenizer(tmp_path / "hf", "")
        return {"tokenizer-model": hf, "data-path": data}, ["renders as no tokens"]
    if name == "no-user-turn":
        hf = _hf_tokenizer(tmp_path / "hf", CHAT)
        return {"tokenizer-model": hf, "data-path": chat}, [f"{chat}:1:", "no user message"]
    if name == "system-prompt-without-template":
        return {"system-prompt": "Be brief."}, ["--system-prompt", "chat template"]
    if name == "text-answers":
        data.write_text('{"prompt": "Spell 2", "answer": "two"}\n')
        return {"data-path": data, "reward-fn": None}, [f"{data}:1: answer 'two' is not a number"]
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name",
    [
        "config-yaml",
        "reward-syntax",
        "reward-exits-on-import",
        "reward-raises-on-import",
        "generation-config",
        "subdirectory",
        "template-raises",
        "template-refuses-system",
        "empty-template",
        "no-user-turn",
        "system-prompt-without-template",
        "text-answers",
    ],
)
def test_start_up_problems_exit_2_naming_the_flag_or_file(tokenizer, tmp_path, capsys, name):
    """Each used to end in a traceback (or, for text answers and the chat prompt without a
    user turn, to crash after the warm-up), none with the flag or the file named."""
    import torch.distributed as dist

    import pretrain_rl  # noqa: F401  (the repository root is on sys.path under pytest)

    flags, needles = _case(name, tmp_path, tokenizer)
    out = {"output-dir": tmp_path / "o"}
    argv = (
        [*tiny_argv(tokenizer, **out), *flags]
        if isinstance(flags, list)
        else tiny_argv(tokenizer, **flags, **out)
    )
    with pytest.raises(SystemExit) as refused:
        pretrain_rl.main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not dist.is_initialized() and not (tmp_path / "o").exists()


def test_a_garbled_architecture_file_is_refused_on_resume(tokenizer, tmp_path, capsys):
    root = tmp_path / "ckpt"
    (root / "iter_0000001").mkdir(parents=True)
    (root / "iter_0000001" / "metadata.json").write_text("{}")
    manifest = {"files": {"metadata.json": {"bytes": 2}}}
    (root / "iter_0000001" / "manifest.json").write_text(json.dumps(manifest))
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (root / "loggra_model_args.json").write_text('{"num_layers": 2, "hidden_')
    with pytest.raises(SystemExit) as refused:
        parse_args(tiny_argv(tokenizer, load=root, save=root))
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "loggra_model_args.json is not a readable" in err, err
