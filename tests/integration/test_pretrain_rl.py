"""`torchrun pretrain_rl.py`: flag validation and end-to-end GRPO runs on 2 CPU processes."""

import importlib.util
import json
import math
import os
import signal
import sys
import time

import psutil
import pytest
import warm_launch
from rl_runs import ENV, REWARD, ROOT, signal_rank_when, tiny_argv, torchrun

from loggra_megatron.arguments import parse_args
from loggra_megatron.convert.hf_config import gpt_args_from_hf
from loggra_megatron.metric_keys import METRICS
from loggra_megatron.metrics import read_metrics

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


# ---------------------------------------------------------------- rejected configurations
@pytest.mark.parametrize(
    ("overrides", "world", "flag"),
    [
        ({"tensor-model-parallel-size": 3}, 3, "--num-attention-heads"),
        ({"tensor-model-parallel-size": 2}, 3, "--tensor-model-parallel-size"),
        ({"global-batch-size": 6}, 2, "--global-batch-size"),
        ({"prompts-per-step": 3}, 2, "--prompts-per-step"),
        ({"fp8-format": "hybrid", "bf16": True, "device": "cpu"}, 1, "--fp8-format"),
        ({"tokenizer-model": "/nonexistent/tok.model"}, 1, "--tokenizer-model"),
        ({"data-path": "/nonexistent/prompts.jsonl"}, 1, "--data-path"),
        ({"loggra-rank": 65}, 1, "--loggra-rank"),
        ({"num-layers": 3, "pipeline-model-parallel-size": 2}, 2, "--num-layers"),
        ({"kl-target": 0.01}, 1, "--kl-target"),  # needs --bf16
        ({"kl-target": -1.0, "bf16": True}, 1, "--kl-target"),
        ({"max-new-tokens": 64}, 1, "--max-new-tokens"),
        ({"num-generations": 1}, 1, "--num-generations"),
        ({"optimizer": "sgd"}, 1, "--optimizer"),
        ({"grad-reduce-in-bf16": True}, 1, "--grad-reduce-in-bf16"),  # needs --bf16
        ({"loggra-projection": "galore"}, 1, "--loggra-projection"),
        ({"loggra-update-interval": 0}, 1, "--loggra-update-interval"),
        # non-finite or out-of-range numbers, refused before anything starts
        ({"lr": "inf"}, 1, "--lr"),
        ({"lr": "nan"}, 1, "--lr"),
        ({"kl-coef": "inf"}, 1, "--kl-coef"),
        ({"temperature": "nan"}, 1, "--temperature"),
        ({"kl-target": "inf", "bf16": True}, 1, "--kl-target"),
        (
            {"kl-target": 0.1, "bf16": True, "kl-backtrack-tolerance": "inf"},
            1,
            "--kl-backtrack-tolerance",
        ),
        ({"adam-beta1": 1.0}, 1, "--adam-beta1"),
        ({"adam-eps": 0.0}, 1, "--adam-eps"),
        ({"clip-grad": -1.0}, 1, "--clip-grad"),
        ({"seed": -1}, 1, "--seed"),
        ({"micro-batch-size": 0}, 1, "--micro-batch-size"),  # was a ZeroDivisionError
        ({"ppo-epochs": 0}, 1, "--ppo-epochs"),
        ({"ppo-epochs": -1}, 1, "--ppo-epochs"),
        ({"clip-high": -1.0}, 1, "--clip-high"),
        ({"fp8-recipe": "bogus"}, 1, "--fp8-recipe"),
        ({"fp8-format": "hybrid", "bf16": True, "transformer-impl": "local"}, 1, "--fp8-format"),
        ({"max-consecutive-skipped-steps": -1}, 1, "--max-consecutive-skipped-steps"),
        ({"hidden-size": 66}, 1, "--hidden-size"),
        ({"task-operators": "+/"}, 1, "--task-operators"),
        # settings Megatron would only refuse after the process group started (exit 1)
        (
            {
                "hidden-size": 96,
                "num-attention-heads": 6,
                "tensor-model-parallel-size": 3,
                "loggra-rank": 8,
            },
            3,
            "--ffn-hidden-size",
        ),
        ({"device": "cuda"}, 1, "--device"),
        ({"transformer-impl": "transformer_engine"}, 1, "--transformer-impl"),
        (
            {"overlap-param-gather": True, "no-use-distributed-optimizer": True},
            1,
            "--overlap-param-gather",
        ),
        ({"min-lr": 1.0}, 1, "--min-lr"),
        # GPU readiness: recompute, sequence parallelism, rollout engines
        ({"recompute-granularity": "full"}, 1, "--recompute-granularity"),  # no method
        ({"recompute-method": "uniform"}, 1, "--recompute-method"),  # not full
        (
            {"recompute-granularity": "selective", "recompute-num-layers": 1},
            1,
            "--recompute-num-layers",
        ),
        ({"recompute-granularity": "some"}, 1, "--recompute-granularity"),
        ({"sequence-parallel": True}, 1, "--sequence-parallel"),  # TP = 1
        (
            {"sequence-parallel": True, "tensor-model-parallel-size": 2},
            2,
            "--sequence-parallel",
        ),  # the local spec refuses it
        ({"sequence-packing": True}, 1, "--sequence-packing"),  # TE's THD kernels: bf16
        ({"sequence-packing": True, "bf16": True}, 1, "--sequence-packing"),  # no TE here
        ({"rollout-engine": "dynamic", "device": "cpu"}, 1, "--rollout-engine"),
        ({"rollout-engine": "paged"}, 1, "--rollout-engine"),
        ({"inference-max-tokens": 0}, 1, "--inference-max-tokens"),
        ({"tis-cap": 0.5}, 1, "--tis-cap"),
        ({"log-prob-micro-batch-size": 0}, 1, "--log-prob-micro-batch-size"),
        ({"loggra-param-remainders": True}, 1, "--loggra-param-remainders"),  # needs --bf16
        (
            {"loggra-param-remainders": True, "bf16": True, "optimizer": "adam"},
            1,
            "--loggra-param-remainders",
        ),
        (
            {"loggra-param-remainders": True, "bf16": True, "loggra-fp32-grad-copy": True},
            1,
            "--loggra-param-remainders",
        ),
    ],
)
def test_bad_configuration_exits_2_naming_the_flag(tokenizer, overrides, world, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(tiny_argv(tokenizer, **overrides), world_size=world)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.fixture
def simulated_hopper(monkeypatch):
    """A CUDA device of compute capability (9, 0) with Transformer Engine and flash-attn, as
    far as start-up checks can tell (nothing runs on it)."""
    import importlib.machinery
    import types

    import torch

    import loggra_megatron.rollout.dynamic.mcore_engine as mcore_engine

    fake = types.ModuleType("transformer_engine")
    fake.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(mcore_engine, "missing_attention_kernels", lambda: None)
    return capability


FP8 = {"bf16": True, "fp8-format": "hybrid", "transformer-impl": "transformer_engine"}


@pytest.mark.parametrize(
    ("overrides", "flag", "reason"),
    [
        ({**FP8, "fp8-recipe": "mxfp8"}, "--fp8-recipe", "Blackwell"),
        ({"rollout-engine": "dynamic"}, "--rollout-engine", "fp16/bf16"),
        ({"rollout-engine": "dynamic", "bf16": True, "tis-cap": 2}, "--tis-cap", "own log-probs"),
        ({"bf16": True, "tis-cap": 2}, "--tis-cap", "the dynamic engine"),  # auto takes it
        (
            {**FP8, "fp8-recipe": "blockwise", "rollout-engine": "dynamic"},
            "--rollout-engine",
            "blockwise",
        ),
    ],
)
def test_what_the_gpu_or_engine_cannot_run_exits_2(
    tokenizer, simulated_hopper, capsys, overrides, flag, reason
):
    """Refused before any process group on a Hopper GPU: MXFP8 needs Blackwell, flash-attn
    takes fp16/bf16 only, blockwise FP8's workspace breaks under the dynamic engine."""
    with pytest.raises(SystemExit) as exc:
        parse_args(tiny_argv(tokenizer, **overrides))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and reason in err, err


def test_fp8_needs_ada_or_hopper(tokenizer, simulated_hopper, capsys):
    simulated_hopper[0] = (8, 0)
    with pytest.raises(SystemExit) as exc:
        parse_args(tiny_argv(tokenizer, **FP8))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--fp8-format" in err and "8.0" in err, err


def test_what_the_gpu_and_engine_can_run_is_accepted(tokenizer, simulated_hopper):
    cfg = parse_args(tiny_argv(tokenizer, **FP8, **{"rollout-engine": "dynamic"}))
    assert cfg.model.fp8_recipe == "tensorwise"  # current scaling: the RL default
    parse_args(tiny_argv(tokenizer, **FP8, **{"fp8-recipe": "blockwise"}))  # static engine
    simulated_hopper[0] = (10, 0)  # Blackwell
    parse_args(tiny_argv(tokenizer, **FP8, **{"fp8-recipe": "mxfp8"}))


def test_yaml_config_supplies_defaults_and_flags_override(tokenizer, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("hidden-size: 128\nnum_attention_heads: 8\nlr: 0.5\n")
    cfg = parse_args(
        [
            *tiny_argv(tokenizer, **{"hidden-size": None, "num-attention-heads": None}),
            "--config",
            str(config),
            "--lr",
            "0.25",
        ]
    )
    assert (cfg.model.hidden_size, cfg.model.num_attention_heads) == (128, 8)
    assert cfg.optimizer.lr == 0.25
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        parse_args([*tiny_argv(tokenizer), "--config", str(bad)])
    typed = tmp_path / "typed.yaml"  # YAML 1.1 reads 1e-5 as a string: converted like a flag
    typed.write_text("lr: 1e-5\nbf16: true\n")
    cfg = parse_args([*tiny_argv(tokenizer, lr=None), "--config", str(typed)])
    assert cfg.optimizer.lr == 1e-5 and cfg.model.bf16 is True
    typed.write_text("num-layers: 2.5\n")
    with pytest.raises(SystemExit):
        parse_args([*tiny_argv(tokenizer, **{"num-layers": None}), "--config", str(typed)])


# ---------------------------------------------------------------- end to end
def _check_metrics(out_dir, steps):
    rows = read_metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert set(row) <= set(METRICS), set(row) - set(METRICS)
        for key in ("loss/total", "reward/mean", "memory/optimizer_state_bytes", "time/step_s"):
            assert row[key] is not None and math.isfinite(row[key]), key
    return rows


@pytest.mark.parametrize(
    "parallel",
    [
        {"tensor-model-parallel-size": 2},
        {"pipeline-model-parallel-size": 2},
        {"grad-reduce-in-bf16": True},  # DP=2; bf16 grads reach LoGRA uncopied
    ],
    ids=["tp2", "pp2", "dp2-bf16-grads"],
)
def test_grpo_steps_end_to_end(tokenizer, tmp_path, parallel):
    out = tmp_path / "run"
    torchrun(
        tiny_argv(
            tokenizer,
            **parallel,
            **{"output-dir": out, "bf16": True, "kl-target": 0.05, "kl-coef": 0.01},
            **{"kl-realized-interval": 1},  # kl/realized on every update (default: every 4th)
        )
    )
    rows = _check_metrics(out, 2)
    assert any(r["grad/norm"] > 0 for r in rows)  # the digit reward gives a real signal
    energy = [r[k] for r in rows for k in r if k.startswith("loggra/captured_energy/")]
    assert len(energy) == 8 * sum(r["grad/norm"] > 0 for r in rows)  # 4 families, mean + min
    assert all(0 < e <= 1 for e in energy)
    assert all(0 < r["kl/step_scale"] <= 1 for r in rows)
    assert all(r["kl/realized"] is not None for r in rows)
    assert all(r["kl/probe_skipped"] in (0.0, 1.0, 2.0) for r in rows)  # of 2 updates


GREEDY = {"temperature": 0, "kl-coef": 0.01}
"""The flags of the shared one-process baseline run (``greedy_run``)."""


@pytest.fixture(scope="module")
def greedy_run(tokenizer, tmp_path_factory):
    """One greedy, one-process run with a reference model: the baseline that the recompute,
    bounded-rollout and importance-sampling tests each compare a variant with (one launch
    for the three)."""
    out = tmp_path_factory.mktemp("greedy") / "run"
    torchrun(tiny_argv(tokenizer, **GREEDY, **{"output-dir": out}), nproc=1)
    return out


def _same_numbers(a_dir, b_dir, keys, rel=0.0):
    for a, b in zip(read_metrics(a_dir), read_metrics(b_dir), strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=rel), (a["step"], key)


def test_activation_recompute_changes_no_number(tokenizer, tmp_path, greedy_run):
    """--recompute-granularity full (uniform, every layer) and selective (core attention)
    train exactly as without recompute (``greedy_run``): same losses, KL and rewards (1
    process, fp32)."""
    runs = {
        "full": {
            "recompute-granularity": "full",
            "recompute-method": "uniform",
            "recompute-num-layers": 1,
        },
        "selective": {"recompute-granularity": "selective"},
    }
    for name, flags in runs.items():
        torchrun(
            tiny_argv(tokenizer, **GREEDY, **flags, **{"output-dir": tmp_path / name}), nproc=1
        )
    keys = ("loss/total", "loss/policy", "kl/ref", "reward/mean", "grad/norm")
    for name in runs:
        _same_numbers(greedy_run, tmp_path / name, keys, rel=1e-6)


def test_bounded_rollouts_and_micro_batched_log_probs_change_no_number(
    tokenizer, tmp_path, greedy_run
):
    """Greedy rollouts: a KV budget of 2 rows (--inference-max-tokens) and reference
    log-probs one sequence at a time (--log-prob-micro-batch-size 1) give the rollouts,
    rewards and KL of one big batch (``greedy_run``); the logged KV cache shrinks from 16
    rows to 4 (rows of 32 tokens: the longest prompt, 20, plus 12 new)."""
    bounded = {"inference-max-tokens": 2 * 64, "log-prob-micro-batch-size": 1}
    torchrun(tiny_argv(tokenizer, **GREEDY, **bounded, **{"output-dir": tmp_path / "b"}), nproc=1)
    _same_numbers(greedy_run, tmp_path / "b", ("reward/mean", "response/length_mean"))
    _same_numbers(greedy_run, tmp_path / "b", ("kl/ref", "loss/total"), rel=1e-5)
    for whole, b in zip(read_metrics(greedy_run), read_metrics(tmp_path / "b"), strict=True):
        assert b["memory/kv_cache_bytes"] * 4 == whole["memory/kv_cache_bytes"]
        assert b["throughput/rollout_tokens_per_s"] > 0 and b["time/rollout_s"] > 0


def test_truncated_importance_sampling_and_on_policy_old_log_probs(tokenizer, tmp_path, greedy_run):
    """Greedy rollouts, fp32: the static engine's log-probs are within 1e-3 of the trainer's
    (``rollout/logprob_mismatch``), so ``--tis-cap 2`` weights every token by about 1 and
    trains as without it (``greedy_run``), with π_old recomputed (2 updates per RL step) or,
    with one update per step (global batch = rollout batch), the training forward's own:
    ratio 1."""
    runs = {
        "tis": {"tis-cap": 2},  # 16 rollouts, global batch 8: π_old recomputed
        "on_policy": {"tis-cap": 2, "global-batch-size": 16},  # π_old: the forward's own
    }
    for name, flags in runs.items():
        argv = tiny_argv(tokenizer, **GREEDY, **flags, **{"output-dir": tmp_path / name})
        torchrun(argv, nproc=1)
    base = read_metrics(greedy_run)
    tis, on_policy = (read_metrics(tmp_path / name) for name in runs)
    for row in base:
        assert 0 <= row["rollout/logprob_mismatch"] < 1e-3 and "tis/weight_mean" not in row
    for row in tis + on_policy:
        assert row["tis/weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert 0 <= row["rollout/logprob_mismatch"] < 1e-3
    _same_numbers(greedy_run, tmp_path / "tis", ("reward/mean",))
    _same_numbers(greedy_run, tmp_path / "tis", ("loss/total", "grad/norm"), rel=1e-3)
    assert all(r["ratio/mean"] == 1.0 and r["clip/fraction"] == 0.0 for r in on_policy)


def test_failing_reward_function_stops_the_run_with_index_and_traceback(tokenizer, tmp_path):
    proc = torchrun(
        tiny_argv(
            tokenizer, **{"reward-fn": f"{REWARD}:always_fails", "output-dir": tmp_path / "r"}
        ),
        nproc=1,
        check=False,
    )
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "raised on sample 0 at RL step 1 (dataset prompt index" in log
    assert "9 of the batch's 16 rewards failed, more than --reward-max-error-fraction 0.5" in log
    assert "ZeroDivisionError" in log and "deliberate failure" in log
    metrics = tmp_path / "r" / "metrics.jsonl"
    assert not metrics.exists() or read_metrics(metrics) == []  # no silent zero-reward step


def test_a_reward_holding_the_gil_is_counted_and_signals_still_save_and_exit(tokenizer, tmp_path):
    """A user reward stuck in a GIL-holding regex ran on for 90 s under --reward-timeout 3 and
    ignored SIGINT twice and SIGTERM. In a worker process now, it is killed at --reward-timeout
    2 and counted (reward/errors), and Ctrl-C (SIGINT to the whole process group, twice) and
    SIGTERM during it end the run at the step's end with a checkpoint, exit 0, and no worker
    process left."""
    save, marker = tmp_path / "ckpt", tmp_path / "reward_started"
    flags = {
        "reward-fn": f"{REWARD}:backtracks_once",
        "reward-timeout": 2,
        "train-iters": 1000,
        "save": save,
    }
    env = {**ENV, "REWARD_MARKER": str(marker)}
    with warm_launch.Launch("pretrain_rl.py", tiny_argv(tokenizer, **flags), env=env) as run:
        rank = psutil.Process(run.pid())  # the leader of its own process group
        deadline = time.time() + 240
        while not marker.exists() and rank.is_running() and time.time() < deadline:
            time.sleep(0.05)
        workers = [c.pid for c in rank.children() if "reward_workers" in " ".join(c.cmdline())]
        for signum in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
            os.killpg(run.pid(), signum)
            time.sleep(0.2)
        code, out = run.wait(120), run.output()
    assert code == 0, out[-3000:]
    assert "SIGINT on rank 0" in out and "saved checkpoint" in out
    assert "1 of 16 rewards failed" in out and "did not return within --reward-timeout 2 s" in out
    assert read_metrics(save)[0]["reward/errors"] == 1
    assert len(workers) == 2 and not any(psutil.pid_exists(pid) for pid in workers)


def test_h100_example_flags_pass_validation(tokenizer, tmp_path, capsys):
    """The 8-GPU launch script's flags are valid (FP8, Transformer Engine where it is not
    installed and sequence parallelism are refused here only for lack of a GPU stack)."""
    with open(os.path.join(ROOT, "examples", "h100_8gpu", "train_27b_loggra.sh")) as f:
        script = f.read()
    body = script.split("pretrain_rl.py", 1)[1].split('"$@"')[0]

    gpt_args_from_hf(os.path.join(ROOT, "tools", "configs", "llama-style-27b.json")).save_json(
        tmp_path / "loggra_model_args.json"
    )
    release = tmp_path / "release"  # a converted model's files (weights not read here)
    release.mkdir()
    (release / "metadata.json").write_text("{}")
    manifest = {"files": {"metadata.json": {"bytes": 2}}}
    (release / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    paths = {
        '"$LOAD"': tmp_path,
        '"$TOKENIZER"': tokenizer,
        '"$DATA"': data,
        '"$OUT"': tmp_path / "out",
    }
    argv = [str(paths.get(a, a)) for a in body.replace("\\\n", " ").split()]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=8)
    assert "--fp8-format" in capsys.readouterr().err
    i = argv.index("--fp8-format")
    argv = argv[:i] + argv[i + 4 :]  # drop --fp8-format/--fp8-recipe
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(SystemExit):
            parse_args(argv, world_size=8)
        assert "--transformer-impl: transformer_engine is not installed" in capsys.readouterr().err
        i = argv.index("--transformer-impl")
        argv = argv[:i] + argv[i + 2 :]
    with pytest.raises(SystemExit):  # TE layers only (the local spec refuses it)
        parse_args(argv, world_size=8)
    assert "--sequence-parallel: needs Transformer Engine layers" in capsys.readouterr().err
    argv.remove("--sequence-parallel")
    cfg = parse_args(argv, world_size=8)
    assert cfg.rollout.inference_max_tokens and cfg.model.recompute_granularity == "full"
    assert cfg.parallel.tensor_model_parallel_size == 8 and cfg.kl_control.kl_target == 0.01
    assert cfg.model.num_attention_heads == 40  # the converted model's, not the flag default


def test_training_starts_from_a_converted_hugging_face_model(tokenizer, tmp_path):
    """HF Qwen2 (made here, no download) -> tools/convert_checkpoint.py -> pretrain_rl --load."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "hf")
    argv = ["--direction", "hf-to-megatron", "--load", tmp_path / "hf"]
    converted = warm_launch.run("tools/convert_checkpoint.py", [*argv, "--save", tmp_path / "ckpt"])
    assert converted.returncode == 0, converted.stderr[-3000:]
    out = tmp_path / "run"
    flags = {
        "load": tmp_path / "ckpt",
        "output-dir": out,
        "train-iters": 1,
        "bf16": True,
        "num-layers": None,
        "hidden-size": None,
        "num-attention-heads": None,
    }
    torchrun(tiny_argv(tokenizer, **flags), nproc=1)
    (row,) = _check_metrics(out, 1)
    assert row["grad/norm"] > 0


def test_sigterm_saves_a_checkpoint_and_exits(tokenizer, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_argv(tokenizer, **{"train-iters": 1000, "save": save})
    code, _, out = signal_rank_when(argv, lambda line: line.startswith(" step"), nproc=None)
    assert code == 0, out
    assert "SIGTERM" in out and "saved checkpoint" in out
    steps = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= steps < 1000 and len(read_metrics(save)) == steps


def test_weights_only_load_starts_from_the_loaded_policy(tokenizer, tmp_path):
    """--load DIR --no-load-optim: the fp32 master weights follow the loaded weights, so the
    second optimizer step of the first RL step does not revert to the initial weights."""
    common = {"bf16": True, "kl-coef": 0.01}
    first = tmp_path / "first"
    torchrun(tiny_argv(tokenizer, **common, **{"train-iters": 2, "lr": 3e-2}, save=first))
    out = tmp_path / "second"
    torchrun(
        tiny_argv(
            tokenizer,
            **common,
            **{"train-iters": 1, "seed": 4},
            load=first,
            **{"no-load-optim": True, "output-dir": out},
        )
    )
    (row,) = read_metrics(out)
    assert row["kl/ref"] < 0.05  # two optimizer steps away from the loaded reference
