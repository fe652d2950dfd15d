"""``tools/estimate_memory.py --fit``: what fits a node. The 27B example's run (its flags less
those the search chooses) fits one 8×80 GB node with LoGRA holding all its rollouts at once,
and dense Adam only with a KV budget of a few rows, and every configuration it prints, fed
back to the estimator, gives the same total and fits; Qwen2.5-7B fits one node with both,
LoGRA with more rollout rows at once; Llama-3-70B fits no single node and two with LoGRA
only. A flag given fixes what the search would choose."""

from __future__ import annotations

import json
import os

import pytest
from launch_flags import (
    CONFIG_27B,
    ROOT,
    USABLE_GIB,
    estimator_cli,
    flag_list,
    names_flag,
    script_argv,
)

SH = os.path.join(ROOT, "examples", "h100_8gpu", "train_27b_loggra.sh")
QWEN = os.path.join(ROOT, "tools", "configs", "qwen2.5-7b-instruct.json")
LLAMA70 = os.path.join(ROOT, "tools", "configs", "llama-3-70b.json")
SEARCHED = {
    "--world-size",  # --num-nodes instead
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--sequence-parallel",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--micro-batch-size",
    "--inference-max-tokens",
    "--loggra-param-remainders",
    "--grad-reduce-in-bf16",
}
QWEN_RUN = [
    *("--hf-config", QWEN, "--gpu-memory-gb", str(USABLE_GIB), "--expandable-segments"),
    *("--no-nccl-nvls", "--bf16", "--transformer-impl", "transformer_engine"),
    *("--seq-length", "4096", "--max-new-tokens", "3072", "--log-prob-micro-batch-size", "4"),
    *("--prompts-per-step", "64", "--num-generations", "8", "--global-batch-size", "256"),
    *("--optimizer", "loggra", "--loggra-rank", "256", "--kl-target", "0.01"),
    *("--kl-coef", "0.001"),
]


@pytest.fixture(scope="module")
def cli():
    return estimator_cli()


@pytest.fixture(scope="module")
def run_27b(cli) -> list[str]:
    """The 27B example's flags and environment, less what --fit chooses."""
    flags = set(cli.build_parser()._option_string_actions)
    kept = [(f, v) for f, v in flag_list(script_argv(SH, 8, flags)) if f not in SEARCHED]
    return [x for f, values in kept for x in (f, *values)]


def _fit(cli, capsys, argv: list[str]) -> dict:
    assert cli.main([*argv, "--fit", "--fit-top", "20", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _estimate(cli, capsys, argv: list[str]) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _job_rows(best: dict) -> int:
    return best["max_rollout_rows"] * best["dp"]


def test_27b_fits_one_node_with_loggra_and_its_flags_estimate_the_same(cli, capsys, run_27b):
    argv = [*run_27b, "--num-nodes", "1"]
    res = _fit(cli, capsys, argv)
    assert res["world"] == 8 and res["refused"] == 0
    # dense Adam (the reference offloaded): a few settings, none with all 64 rollouts at once
    dense = res["adam"]["best"][0]
    assert res["adam"]["fit"] >= 1 and all(b["kv_rows"] < 64 for b in res["adam"]["best"])
    assert res["adam"]["closest"]["fits"] and dense["total"] < USABLE_GIB
    assert res["loggra"]["fit"] > 5 * res["adam"]["fit"]
    for best in res["loggra"]["best"]:
        assert best["free"] >= 1.0  # --fit-headroom-gb
        again = _estimate(cli, capsys, [*argv, *best["flags"]])["loggra"]
        assert again["fits"] and again["total"] == pytest.approx(best["total"], abs=1e-9)
    top = res["loggra"]["best"][0]
    assert (top["tp"], top["pp"], top["dp"]) == (8, 1, 1) and top["kv_rows"] == 64
    # the dense Adam run, fed back, is what the dense column says
    again = _estimate(cli, capsys, [*argv, *dense["flags"]])["adam"]
    assert again["fits"] and again["total"] == pytest.approx(dense["total"], abs=1e-9)


def test_7b_fits_one_node_with_both_and_loggra_holds_more_rollouts(cli, capsys):
    argv = [*QWEN_RUN, "--num-nodes", "1"]
    res = _fit(cli, capsys, argv)
    assert res["refused"] > 0  # TP 8 (28 heads) and PP 8 (28 layers): pretrain_rl.py refuses
    dense, loggra = res["adam"]["best"], res["loggra"]["best"]
    assert dense and loggra
    assert _job_rows(loggra[0]) > _job_rows(dense[0])
    assert all(b["tp"] in (1, 2, 4) for b in dense + loggra)
    for best, column in ((dense[0], "adam"), (loggra[0], "loggra")):
        again = _estimate(cli, capsys, [*argv, *best["flags"]])[column]
        assert again["fits"] and again["total"] == pytest.approx(best["total"], abs=1e-9)


def test_70b_fits_one_node_and_two_with_loggra_only(cli, capsys, run_27b):
    """With the 27B example's flags (the backward sketch, remainders, the reference
    offloaded) a 70B policy fits one 8-GPU node with LoGRA, at TP 8 or TP 4 × PP 2 with a
    KV budget below the 64 rollouts; dense Adam fits neither one node nor two."""
    argv = [*run_27b, "--hf-config", LLAMA70]
    one = _fit(cli, capsys, [*argv, "--num-nodes", "1"])
    assert one["loggra"]["fit"] > 0 and one["adam"]["fit"] == 0
    assert all(b["tp"] * b["pp"] == 8 and b["kv_rows"] < 64 for b in one["loggra"]["best"])
    two = _fit(cli, capsys, [*argv, "--num-nodes", "2"])
    assert two["world"] == 16 and two["adam"]["fit"] == 0
    assert (two["loggra"]["best"][0]["tp"], two["loggra"]["best"][0]["pp"]) == (8, 2)
    assert two["loggra"]["fit"] > one["loggra"]["fit"]
    assert two["loggra"]["closest"]["total"] < two["adam"]["closest"]["total"]


def test_the_27b_split_searches_the_training_gpus_and_sizes_the_generation_kv(cli, capsys):
    """The paper's 4 + 4 split (the split example's flags less what --fit chooses): the
    layouts use the 4 training GPUs only, the KV budget is a generation GPU's (the training
    GPUs hold no KV cache), a configuration fits when both kinds of GPU do, and each, fed
    back to the estimator, gives the same totals; dense Adam fits no training GPU."""
    split = os.path.join(ROOT, "examples", "h100_8gpu", "train_27b_loggra_split.sh")
    flags = set(cli.build_parser()._option_string_actions)
    kept = [(f, v) for f, v in flag_list(script_argv(split, 8, flags)) if f not in SEARCHED]
    argv = [x for f, values in kept for x in (f, *values)] + ["--num-nodes", "1"]
    res = _fit(cli, capsys, argv)
    assert res["generation_ranks"] == 4 and res["adam"]["fit"] == 0
    assert res["loggra"]["fit"] > 0
    for best in res["loggra"]["best"]:
        assert best["tp"] * best["pp"] * best["dp"] == 4 and best["generation_total"] > 0
        assert best["kv_rows"] <= best["max_rollout_rows"] < 64  # 64 rollouts, one replica
        again = _estimate(cli, capsys, [*argv, *best["flags"]])
        assert again["loggra"]["total"] == pytest.approx(best["total"], abs=1e-9)
        assert again["loggra"]["kv_cache"] == 0 and again["generation"]["fits"]
        assert again["generation"]["total"] == pytest.approx(best["generation_total"], abs=1e-9)
        assert again["generation"]["kv_cache"] > 0


def test_a_given_flag_fixes_what_the_search_would_choose(cli, capsys):
    argv = [*QWEN_RUN, "--num-nodes", "1", "--tensor-model-parallel-size", "2"]
    argv += ["--micro-batch-size", "1", "--inference-max-tokens", "262144"]
    res = _fit(cli, capsys, argv)
    for b in res["loggra"]["best"] + res["adam"]["best"]:
        assert (b["tp"], b["micro_batch_size"], b["kv_rows"]) == (2, 1, 64)
        assert not {"--tensor-model-parallel-size", "--micro-batch-size"} & set(b["flags"])
        assert "--inference-max-tokens" not in b["flags"]


def test_num_nodes_is_the_world_without_fit(cli, capsys):
    base = ["--hf-config", CONFIG_27B, "--tensor-model-parallel-size", "8", "--bf16"]
    nodes = _estimate(cli, capsys, [*base, "--num-nodes", "2"])
    world = _estimate(cli, capsys, [*base, "--world-size", "16"])
    assert nodes == world


@pytest.mark.parametrize(
    "extra,name",
    [
        (["--fit-top", "3"], "--fit-top"),  # without --fit
        (["--num-nodes", "1", "--world-size", "8"], "--num-nodes"),
        (["--fit", "--num-nodes", "0"], "--num-nodes"),
    ],
)
def test_fit_flags_are_checked(cli, capsys, extra, name):
    with pytest.raises(SystemExit) as e:
        cli.main(["--hf-config", CONFIG_27B, *extra])
    assert e.value.code == 2 and names_flag(capsys.readouterr().err, name)
