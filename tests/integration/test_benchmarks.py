"""The RL-step memory benchmark's accounting, and the GPU check script's flags.

``benchmarks/memory_rl.py`` is what ``docs/results.md`` quotes, and
``benchmarks/gpu/h200_check.sh`` can only run on a GPU: these tests keep both from
rotting on CPU (a flag the script passes that the benchmark no longer accepts fails here).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import warm_launch

from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

ROOT = str(Path(__file__).resolve().parents[2])
BENCH = os.path.join(ROOT, "benchmarks", "memory_rl.py")
sys.path.insert(0, os.path.dirname(BENCH))  # the benchmarks import tiny_example as scripts do
GPU_CHECK = os.path.join(ROOT, "benchmarks", "gpu", "h200_check.sh")


def _warm(cmd: list) -> subprocess.CompletedProcess:
    """``cmd`` (``[python, script, *args]``) forked from the harness's warm server
    (``warm_launch``); the finished process, which must have exited 0."""
    proc = warm_launch.run(cmd[1], list(map(str, cmd[2:])), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _memory_rl():
    spec = importlib.util.spec_from_file_location("memory_rl", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_passes_flags_the_benchmark_accepts():
    with open(GPU_CHECK) as f:
        text = f.read()
    shape = re.search(r"SHAPE=\((.*?)\)", text, re.S).group(1)
    flags = shlex.split(shape.replace("\n", " "))
    runs = re.findall(r'memory_rl\.py "\$\{SHAPE\[@\]\}"(.*)', text)
    assert len(runs) == 2  # bf16, then FP8 when Transformer Engine is importable
    bench = _memory_rl()
    for extra in runs:
        args = bench.parse_args([*flags, *shlex.split(extra)])
        assert args.device == "cuda" and args.hidden == 2048 and args.layers == 16
        # dense Adam and the backward sketch first: a timeout still leaves that comparison
        assert args.optimizers == ["dense", "backward", "loggra"]
    assert bench.parse_args([]).optimizers == ["dense", "backward", "loggra"]
    assert bench.parse_args([*flags, "--fp8", "hybrid"]).fp8 == "hybrid"
    with pytest.raises(SystemExit):
        bench.parse_args(["--fp8", "hybrid"])  # FP8 on CPU is refused


def _measure_bf16_grads(rank):
    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(device="cpu")
    bench = _memory_rl()
    args = bench.parse_args(
        [
            "--layers",
            "2",
            "--hidden",
            "64",
            "--ffn",
            "176",
            "--heads",
            "4",
            "--vocab",
            "128",
            "--seq",
            "16",
            "--timed-steps",
            "1",
        ]
    )
    return {
        kind: bench.measure(kind, args, bf16_grads=True, with_reference=True)
        for kind in ("dense", "loggra")
    }, args


def test_memory_rl_counts_megatrons_fp32_grad_copies_and_loggras_one_weight():
    ((result, args),) = run_distributed(_measure_bf16_grads, 1)
    h, f, v = args.hidden, args.ffn, args.vocab
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # qkv + proj + fc1 (gate, up) + fc2 + 2 norms
    bf16_params = args.layers * per_layer + 2 * v * h + h  # + embedding, output, final norm
    dense, loggra = result["dense"], result["loggra"]
    assert dense["step_grads"] == 4 * bf16_params  # every bf16 grad copied to fp32 at once
    assert loggra["step_grads"] == 4 * max(v * h, 2 * f * h)  # the largest weight, alone
    assert loggra["state"] < dense["state"]
    assert loggra["peak"] < dense["peak"]


def test_bench_rollout_smoke(tmp_path):
    """``benchmarks/bench_rollout.py`` at a tiny size (greedy, whole batch vs 1/2 of its KV
    tokens): both variants in the JSON, positive rates, the budget halves the KV cache and
    the chunked greedy tokens equal the whole batch's."""
    import json
    import sys

    out = tmp_path / "rollout.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "bench_rollout.py"),
        "--model",
        "tiny",
        "--rows",
        "4",
        "--prompt-min",
        "2",
        "--prompt-max",
        "5",
        "--max-new-tokens",
        "3",
        "--repeats",
        "1",
        "--fractions",
        "2",
        "--modes",
        "greedy",
        "--json",
        str(out),
    ]
    _warm(cmd)
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"old", "new 1/2"}
    for r in results.values():
        assert r["mode"] == "greedy" and r["generated_tokens"] == 4 * 3
        assert r["tokens_per_s"] > 0 and r["median_seconds"] > 0 and r["kv_bytes"] > 0
        assert r["peak_bytes"] >= 0 and r["rss_before_bytes"] > 0
        assert r["tokens_identical_to_old"]
    old, new = results["old"], results["new 1/2"]
    assert old["max_tokens"] is None and old["rows_per_chunk"] == 4
    assert new["rows_per_chunk"] == 2 and new["kv_bytes"] <= old["kv_bytes"] / 2


def test_reward_parity_configurations_pass_validation(tokenizer):
    """Every arm of benchmarks/reward_parity.py is a valid pretrain_rl.py command (dense
    Adam with a LoGRA flag would now be refused: a flag that does nothing)."""
    from loggra_megatron.arguments import parse_args

    spec = importlib.util.spec_from_file_location(
        "reward_parity", os.path.join(ROOT, "benchmarks", "reward_parity.py")
    )
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    for name, flags in parity.CONFIGS.items():
        argv = ["--tokenizer-model", tokenizer, *parity.COMMON, *flags]
        cfg = parse_args([a.format(kl_target=1e-4) for a in argv], world_size=2)
        assert cfg.optimizer.optimizer in ("adam", "loggra"), name


def test_pretrained_rl_arms_pass_validation(tokenizer, tmp_path):
    """Every arm of benchmarks/pretrained_rl.py is a valid pretrain_rl.py command on the
    example's flags (a sentencepiece tokenizer and a tiny architecture standing in for the
    converted model), and the recipe arm takes the documented config's settings."""
    from loggra_megatron.arguments import parse_args

    spec = importlib.util.spec_from_file_location(
        "pretrained_rl", os.path.join(ROOT, "benchmarks", "pretrained_rl.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "data").mkdir()
    for split in ("train", "eval"):
        (tmp_path / "data" / f"{split}.jsonl").write_text('{"prompt": "1+2", "answer": "3"}\n')
    argv = bench.common(str(tmp_path), 2, 16)
    argv[argv.index("--tokenizer-model") + 1] = tokenizer
    tiny = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4"]
    optimizers = {}
    for name, flags in bench.ARMS.items():
        cfg = parse_args([*argv, *tiny, *flags], world_size=1)
        assert cfg.grpo.rollout_batch_size == 32, name
        optimizers[name] = cfg
    recipe = optimizers["LoGRA, paper recipe"]
    assert recipe.loggra.loggra_update_ratio == 6e-5 and recipe.loggra.freeze_non_targets
    assert recipe.loggra.loggra_rank == 64 and recipe.kl_control.kl_max_step_scale == 3
    assert optimizers["LoGRA"].loggra.loggra_sketch == "backward"


def test_rank_sweep_arms_are_the_tiny_example_and_pass_validation(tokenizer):
    """Every arm of benchmarks/rank_sweep.py is the tiny example's command (read from
    examples/tiny_cpu/run.sh) with only the optimizer settings changed, and valid."""
    from loggra_megatron.arguments import parse_args

    spec = importlib.util.spec_from_file_location(
        "rank_sweep", os.path.join(ROOT, "benchmarks", "rank_sweep.py")
    )
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    flags = sweep.example_flags()
    assert flags[flags.index("--hidden-size") + 1] == "128" and "--save" not in flags
    rl = sweep.rl_flags(sweep.with_flags(flags, tokenizer_model=tokenizer))
    ranks = {}
    for config in sweep.CONFIGS:
        cfg = parse_args([*sweep.run_flags(config, rl), "--seed", "2"], world_size=2)
        assert cfg.training.seed == 2 and cfg.training.train_iters == sweep.STEPS
        ranks[config] = (cfg.optimizer.optimizer, cfg.loggra.loggra_projection)
        if config.isdigit():
            assert cfg.loggra.loggra_rank == int(config)
    assert ranks["identity"] == ("loggra", "identity") and ranks["adam"][0] == "adam"
    backward = parse_args([*sweep.run_flags("16", rl, "backward"), "--seed", "2"], world_size=2)
    assert backward.loggra.loggra_sketch == "backward" and backward.loggra.loggra_rank == 16


def _chunking_at_a_tiny_shape(rank):
    import sys

    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(device="cpu")
    sys.path.insert(0, os.path.dirname(BENCH))  # its AllocationPeak is memory_rl's
    spec = importlib.util.spec_from_file_location(
        "log_prob_chunking", os.path.join(ROOT, "benchmarks", "log_prob_chunking.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    flags = "--layers 1 --hidden 32 --ffn 64 --heads 4 --vocab 4096 --seq 128 --rows 1"
    args = bench.parse_args([*flags.split(), "--log-prob-chunk-size", "16", "--repeats", "1"])
    return bench.measure(args), args


def test_log_prob_chunking_measures_the_chunked_heads_smaller_transient():
    ((results, args),) = run_distributed(_chunking_at_a_tiny_shape, 1)
    for phase in ("log_probs", "training"):
        whole = results[f"{phase}/unchunked"]["transient_bytes"]
        chunked = results[f"{phase}/chunked"]["transient_bytes"]
        assert whole >= 4 * args.seq * args.vocab  # at least the fp32 logits of the row
        assert chunked < whole / 2


def _estimator_against_a_measured_step(rank):
    import sys

    from loggra_megatron.parallel import initialize_megatron

    initialize_megatron(device="cpu")
    sys.path.insert(0, os.path.dirname(BENCH))  # it imports memory_rl
    spec = importlib.util.spec_from_file_location(
        "estimator_accuracy", os.path.join(os.path.dirname(BENCH), "estimator_accuracy.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    flags = "--layers 2 --hidden 128 --ffn 352 --heads 4 --vocab 512 --seq 32 --timed-steps 1"
    args = bench.parse_args([*flags.split(), "--reference", "yes"])
    settings = {"dense": ((True, False),), "backward": ((True, True),)}
    return bench.compare(args, 1, settings)


def test_estimator_accuracy_compares_each_phase_of_a_measured_step():
    """``benchmarks/estimator_accuracy.py`` at a tiny shape: the estimator's static terms are
    the persistent tensors measured (bytes, up to the JSON's float rounding), and each
    phase's peak is within 10 % (docs/memory.md quotes the default shape's errors)."""
    (rows,) = run_distributed(_estimator_against_a_measured_step, 1)
    assert {(kind, phase) for kind, _, phase, _, _ in rows} == {
        (k, p)
        for k in ("dense", "backward")
        for p in ("static", "rollout", "log_probs", "training")
    }
    for kind, _, phase, measured, estimated in rows:
        if phase == "static":
            assert estimated == pytest.approx(measured, rel=1e-6), kind
        else:
            assert estimated == pytest.approx(measured, rel=0.10), (kind, phase)


def test_rollout_prefill_benchmark_shares_the_prefill(tmp_path):
    """``benchmarks/rollout_prefill.py`` at a tiny shape: both arms sample the same tokens,
    and one prefill per prompt runs 1/G of the prefill tokens (docs/results.md quotes its
    times)."""
    import json

    out = tmp_path / "prefill.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "rollout_prefill.py")]
    cmd += [
        "--layers",
        "1",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--vocab",
        "256",
        "--prompts",
        "2",
        "--num-generations",
        "4",
    ]
    cmd += ["--prompt-tokens", "32", "--new-tokens", "3", "--repeats", "1", "--json", str(out)]
    _warm(cmd)
    result = json.loads(out.read_text())
    assert result["tokens_equal"]
    assert result["every row"]["prefill_tokens"] == 8 * 32
    assert result["shared"]["prefill_tokens"] == 2 * 32
    assert result["decode_ops_per_forward"] > 0


def test_decode_step_benchmark_measures_the_kv_cache(tmp_path):
    """``benchmarks/decode_step.py`` at a tiny shape: a row per batch size, a positive time
    and floor, and the KV cache's bytes measured on the engine's buffers equal to the
    formula (h200_check.sh's ``decode`` section runs it on a GPU)."""
    import json

    out = tmp_path / "decode.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "decode_step.py")]
    cmd += shlex.split("--layers 1 --hidden 64 --heads 4 --groups 2 --vocab 128 --ffn 128")
    cmd += shlex.split("--prompt-tokens 8 --new-tokens 4 --batches 2 4 --repeats 1 --json")
    proc = _warm([*cmd, str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    printed = re.findall(r"^\| (\d+) \| ", proc.stdout, re.M)  # a row per batch size
    assert printed == ["2", "4"]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0 and r["steps"] == 4
        assert r["kv_bytes_measured"] == r["kv_bytes_formula"] > 0
