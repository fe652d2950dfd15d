"""The memory model of ``--loggra-sketch backward`` (LoGRA as published,
``loggra_megatron/memory/backward_sketch.py``): every term's formula against a hand count
(no grad bytes for a target at any DP, masters and RowAdam state of the owned rows only, the
S buffer ``4·Σm·r`` on every rank, remainders, row SGD, a subset of targets, the activations
a frozen fc2 no longer saves, ``P``), the CLI and ``--fit`` with the mode, the benchmark block
of docs/memory.md, and the S buffer, RowAdam state, dense state, target masters and grad
buffer of real tiny Megatron runs at DP = 1 and 2 (CPU ranks)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
from launch_flags import CONFIG_27B, ROOT, estimator_cli, names_flag, read
from memory_plans import plan

from loggra_megatron.memory import backward_sketch as bs
from loggra_megatron.memory.model import (
    estimate_rl_step_memory,
    grad_bytes,
    master_param_bytes,
    optimizer_state_bytes,
    stage_parameters,
)
from loggra_megatron.memory.shape import GiB, TransformerShape, ceil_div
from loggra_megatron.memory.transient import layers_held
from loggra_megatron.optim.backward_sketch.row_updates import ROW_UPDATES
from loggra_megatron.optim.backward_sketch.sketch import ROW_GATHER_BUCKET_NUMEL
from loggra_megatron.optim.registry import SKETCH_TARGETS
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # the real runs below start Megatron-Core ranks

# a small GQA/SwiGLU model whose row counts do not divide every DP size (ceil matters)
SHAPE = TransformerShape(
    num_layers=4,
    hidden_size=320,
    ffn_hidden_size=1000,
    num_attention_heads=10,
    num_query_groups=2,
    vocab_size=1000,
    untie_embeddings_and_output_weights=True,
)
BASE = dict(seq_length=512, rollout_batch_size=0, reference_model=False, loggra_rank=16)


def _step(dp=1, tp=1, sp=False, **kw):
    """The backward sketch's plan at DP ``dp``, TP ``tp`` (sequence parallel: ``sp``)."""
    layout = dict(tensor_model_parallel_size=tp, data_parallel_size=dp, sequence_parallel=sp)
    return plan(**{**BASE, **layout, "optimizer": "loggra", "loggra_sketch": "backward", **kw})


def _split(params, targets=SKETCH_TARGETS):
    is_target = [p.kind == "linear" and bs.target_of(p) in targets for p in params]
    return (
        [p for p, t in zip(params, is_target, strict=True) if t],
        [p for p, t in zip(params, is_target, strict=True) if not t],
    )


@pytest.mark.parametrize("row_optimizer", list(ROW_UPDATES))
def test_row_state_is_what_the_row_update_keeps(row_optimizer):
    """The memory model's row state per owned row is the state RowAdam allocates with that
    ``--loggra-row-optimizer`` (``optim.backward_sketch.row_updates``)."""
    import torch

    from loggra_megatron.optim.backward_sketch.row_adam import RowAdam

    rows = torch.nn.Parameter(torch.zeros(6, 4))
    opt = RowAdam([rows], row_optimizer=row_optimizer)
    opt.set_sketches({rows: (torch.ones(6, 2), torch.ones(2, 4))})
    opt.step()
    kept = sum(t.numel() * t.element_size() for t in opt.state[rows].values())
    assert kept == 6 * ROW_UPDATES[row_optimizer].state_bytes_per_row


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("grads", ["fp32", "bf16"])
def test_targets_have_no_grad_bytes_at_any_dp(dp, grads):
    step = _step(dp, main_grads_dtype=grads)
    params = stage_parameters(SHAPE, step)
    targets, dense = _split(params)
    per = 4 if grads == "fp32" else 2
    got = estimate_rl_step_memory(SHAPE, step)
    gradient = estimate_rl_step_memory(SHAPE, dataclasses.replace(step, loggra_sketch="gradient"))
    assert got.grads == per * sum(p.numel for p in dense) == grad_bytes(dense, per)
    assert gradient.grads - got.grads == per * sum(p.numel for p in targets) > 0
    # bf16 grads: the dense leaves convert one shard at a time, targets have none to convert
    largest = 4 * max(ceil_div(p.numel, dp) for p in dense)
    assert got.main_grad_copies == (largest if grads == "bf16" else 0)


def test_masters_are_the_owned_rows_and_shrink_with_dp():
    params = stage_parameters(SHAPE, _step())
    targets, dense = _split(params)
    totals = []
    for dp in (1, 2, 3, 4, 8):
        got = estimate_rl_step_memory(SHAPE, _step(dp)).master_params
        rows = sum(ceil_div(p.shape[0], dp) * p.shape[1] for p in targets)
        assert got == 4 * rows + master_param_bytes(dense, dp, 4)
        totals.append(got)
    assert totals[0] == 4 * sum(p.numel for p in params)
    assert totals == sorted(totals, reverse=True) and totals[-1] < totals[0] / 7
    # not sharded without the distributed optimizer: every rank owns every row
    whole = _step(8, distributed_optimizer=False)
    assert estimate_rl_step_memory(SHAPE, whole).master_params == totals[0]


def test_masters_as_remainders_and_fp32_models():
    fp32 = estimate_rl_step_memory(SHAPE, _step(4)).master_params
    rem = estimate_rl_step_memory(SHAPE, _step(4, loggra_param_remainders=True))
    assert rem.master_params * 2 == fp32
    assert estimate_rl_step_memory(SHAPE, _step(4, precision="fp32")).master_params == 0


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_sketch_buffer_is_sum_m_times_r_fp32_on_every_rank(dp):
    params = stage_parameters(SHAPE, _step(dp))
    targets, _ = _split(params)
    got = estimate_rl_step_memory(SHAPE, _step(dp)).sketch_buffer
    assert got == 4 * 16 * dp * sum(ceil_div(p.shape[0], dp) for p in targets)
    sum_m = sum(p.shape[0] for p in targets)
    assert 4 * sum_m * 16 <= got < 4 * (sum_m + dp * len(targets)) * 16
    if dp == 1:  # the per-layer rows: qkv (a+2g)d, proj h, fc1 2f, fc2 h
        per_layer = (10 + 4) * 32 + 320 + 2 * 1000 + 320
        assert got == 4 * SHAPE.num_layers * per_layer * 16
    # the same whatever the grad dtype; none for dense Adam or the gradient sketch
    assert estimate_rl_step_memory(SHAPE, _step(dp, main_grads_dtype="bf16")).sketch_buffer == got
    for other in (_step(dp, optimizer="adam"), _step(dp, loggra_sketch="gradient")):
        assert estimate_rl_step_memory(SHAPE, other).sketch_buffer == 0


@pytest.mark.parametrize("dp", [2, 3, 8])
def test_sketch_reduced_per_microbatch_holds_own_rows_and_pays_in_the_hook(dp):
    """``--loggra-sketch-reduce microbatch``: the buffer is this rank's ``[Σ⌈m/D⌉, r]``; the
    hook adds a padded copy and the received rows; the step receives nothing."""
    targets, _ = _split(stage_parameters(SHAPE, _step(dp)))
    step, micro = _step(dp), _step(dp, loggra_sketch_reduce="microbatch")
    at_step, per_micro = (estimate_rl_step_memory(SHAPE, s) for s in (step, micro))
    own = 4 * 16 * sum(ceil_div(p.shape[0], dp) for p in targets)
    assert per_micro.sketch_buffer == own and at_step.sketch_buffer == dp * own
    hook = max(
        4 * 16 * (p.shape[0] + (k * dp if k * dp != p.shape[0] else 0) + k)
        for p in targets
        for k in [ceil_div(p.shape[0], dp)]
    )
    largest_product = 4 * 16 * max(p.shape[0] for p in targets)
    assert per_micro.sketch_projections - at_step.sketch_projections == hook - largest_product
    assert hook > largest_product
    assert per_micro.sketch_step <= at_step.sketch_step
    # one DP rank, or no distributed optimizer: nothing to reduce-scatter, the same terms
    for same in (_step(1), _step(dp, distributed_optimizer=False)):
        other = dataclasses.replace(same, loggra_sketch_reduce="microbatch")
        assert estimate_rl_step_memory(SHAPE, other) == estimate_rl_step_memory(SHAPE, same)


def test_rank_is_clamped_to_the_narrowest_target_width():
    assert bs.sketch_rank(SHAPE, _step(loggra_rank=10_000)) == 320  # qkv/fc1: h
    assert bs.sketch_rank(SHAPE, _step(loggra_rank=10_000, loggra_targets=("linear_fc2",))) == 1000
    assert bs.sketch_rank(SHAPE, _step(loggra_rank=16)) == 16


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_row_adam_state_is_4_bytes_per_owned_row_and_dense_adamw_for_the_rest(dp):
    targets, dense = _split(stage_parameters(SHAPE, _step(dp)))
    dense_state = optimizer_state_bytes(dense, "loggra", dp=dp, sketch=False)
    # the dense leaves: 8 B per element of their shard + LoGRA's 8-byte step per tensor
    assert dense_state == sum(8 * ceil_div(p.numel, dp) + 8 for p in dense)
    rows = sum(ceil_div(p.shape[0], dp) for p in targets)
    adam = estimate_rl_step_memory(SHAPE, _step(dp)).optimizer_state
    sgd = estimate_rl_step_memory(SHAPE, _step(dp, loggra_row_optimizer="sgd"))
    assert adam == dense_state + 4 * rows
    assert sgd.optimizer_state == dense_state


def test_a_subset_of_targets_leaves_the_others_dense():
    subset = ("linear_qkv", "linear_fc1")
    step = _step(2, loggra_targets=subset)
    params = stage_parameters(SHAPE, step)
    targets, dense = _split(params, subset)
    assert {bs.target_of(p) for p in targets} == set(subset)
    assert {"linear_proj", "linear_fc2"} <= {bs.target_of(p) for p in dense}
    got = estimate_rl_step_memory(SHAPE, step)
    assert got.grads == 4 * sum(p.numel for p in dense)
    # proj and fc2 are dense AdamW (8 B per element of their shard), not gradient sketches
    assert got.optimizer_state == sum(8 * ceil_div(p.numel, 2) + 8 for p in dense) + 4 * sum(
        ceil_div(p.shape[0], 2) for p in targets
    )
    assert got.sketch_buffer == 4 * 16 * 2 * sum(ceil_div(p.shape[0], 2) for p in targets)
    gradient = estimate_rl_step_memory(SHAPE, dataclasses.replace(step, loggra_sketch="gradient"))
    assert got.activations == gradient.activations  # fc2 keeps its input


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_training_drops_fc2_input_and_keeps_p(recompute, tp, sp):
    step = _step(tp=tp, sp=sp, recompute_granularity=recompute, micro_batch_size=2)
    gradient = dataclasses.replace(step, loggra_sketch="gradient")
    got, ref = (estimate_rl_step_memory(SHAPE, s) for s in (step, gradient))
    layers, _ = layers_held(SHAPE, step, 0)
    assert layers == (4 if recompute == "none" else 1)
    sb = 2 * 512
    assert ref.activations - got.activations == layers * ceil_div(2 * sb * 1000, tp)
    row_tokens = sb // tp if sp else sb  # proj and fc2 under sequence parallelism
    p_per_layer = 2 * 16 * (2 * sb + 2 * row_tokens)  # bf16 [tokens, r] of 4 targets
    largest_product = 4 * 2 * 1000 // tp * 16  # fc1's [m, r] fp32, one hook at a time
    # the update's packed ±1 projections: ⌈n/8⌉ bytes per row of this rank's [r, n] blocks
    signs = 16 * 4 * sum(ceil_div(n, 8) for n in (320, 320, 320 // tp, 1000 // tp))
    assert got.sketch_projections == layers * p_per_layer + largest_product + signs
    assert ref.sketch_projections == 0


def test_packed_projections_of_the_27b_example():
    """The bytes backward_sites.py and docs/optimizer.md quote: 14 MB per GPU at TP=8, r=128
    (the example's), 28 MB at 256; 16 times that in bf16."""
    shape = TransformerShape(
        num_layers=64,
        hidden_size=5120,
        ffn_hidden_size=22016,
        num_attention_heads=40,
        num_query_groups=8,
        vocab_size=128256,
        untie_embeddings_and_output_weights=True,
    )
    for rank, mb, bf16_mb in ((128, 14, 223), (256, 28, 447)):
        step = _step(tp=8, sp=True, loggra_rank=rank)
        targets, _ = _split(stage_parameters(shape, step))
        assert len(targets) == 256
        packed = bs.signs_cache_bytes(targets, rank)
        assert round(packed / 1e6) == mb and round(16 * packed / 1e6) == bf16_mb
        assert estimate_rl_step_memory(shape, step).sketch_step >= packed


def _step_terms(targets, dp):
    """Each target's update transient, the weight sync's all-gather buffer and the
    reduce-scatter's receive buffer, by hand (r = 16, bf16 weights). The targets of this
    shape are one bucket of the sync: ``[dp, Σ k·n]`` in bf16, rows padded to ``k``."""
    update = 0
    for p in targets:
        n, k = p.shape[1], ceil_div(p.shape[0], dp)
        update = max(update, 8 * k * n + (2 + 4) * 16 * n + 8 * k * 16 + 4 * k)
    gathered = dp * sum(ceil_div(p.shape[0], dp) * p.shape[1] for p in targets)
    assert gathered <= ROW_GATHER_BUCKET_NUMEL  # one bucket
    receive = 4 * sum(ceil_div(p.shape[0], dp) for p in targets) * 16
    return update, 2 * gathered, receive


def test_optimizer_step_transient():
    for dp in (3, 4):
        targets, _ = _split(stage_parameters(SHAPE, _step(dp)))
        update, gather, receive = _step_terms(targets, dp)
        got = estimate_rl_step_memory(SHAPE, _step(dp)).sketch_step
        assert got == max(update, gather, receive) + bs.signs_cache_bytes(targets, 16)
        # the rows (qkv 448, proj and fc2 320, fc1 2000): all divide by 4 (no padding rows
        # in the bucket), none by 3
        unpadded = 2 * sum(p.shape[0] * p.shape[1] for p in targets)
        assert (gather == unpadded) == (dp == 4) and gather >= unpadded
    assert estimate_rl_step_memory(SHAPE, _step(4, optimizer="adam")).sketch_step == 0


def test_dense_adam_and_the_gradient_sketch_ignore_the_backward_settings():
    for opt, sketch in (("adam", "backward"), ("loggra", "gradient")):
        step = _step(2, optimizer=opt, loggra_sketch=sketch, loggra_targets=("linear_fc2",))
        plain = _step(2, optimizer=opt, loggra_sketch="gradient")
        assert estimate_rl_step_memory(SHAPE, step) == estimate_rl_step_memory(SHAPE, plain)


# ---------------------------------------------------------------------- the CLI
EXAMPLE = [
    *("--hf-config", CONFIG_27B, "--world-size", "8", "--tensor-model-parallel-size", "8"),
    *("--sequence-parallel", "--bf16", "--seq-length", "4096", "--max-new-tokens", "3072"),
    *("--recompute-granularity", "full", "--recompute-method", "uniform"),
    *("--recompute-num-layers", "1", "--loggra-rank", "128", "--gpu-memory-gb", "79.1"),
]


@pytest.fixture(scope="module")
def cli():
    return estimator_cli()


def test_cli_reads_the_backward_flags_as_pretrain_rl_does(cli, capsys):
    from loggra_megatron.memory.run_step import modelled_step

    argv = [*EXAMPLE, "--loggra-sketch", "backward", "--loggra-targets", "linear_fc1,linear_qkv"]
    _, cfg, est = cli.parse([*argv, "--loggra-row-optimizer", "sgd"])
    step = modelled_step(cfg, est)[1]
    assert step.loggra_sketch == "backward" and step.loggra_row_optimizer == "sgd"
    assert step.loggra_targets == ("linear_fc1", "linear_qkv")
    assert cli.main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["loggra"]["sketch_buffer"] > 0 == res["adam"]["sketch_buffer"]
    assert res["loggra"]["grads"] < res["adam"]["grads"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "LoGRA bwd r=128*" in out and "sketch buffer S (fp32)" in out
    assert "backward sketch of linear_fc1,linear_qkv (row adam)" in out
    for bad in (["--loggra-targets", "linear_qkv"], ["--loggra-refresh-interval", "2"]):
        with pytest.raises(SystemExit) as e:  # a backward-only setting without the mode
            cli.main([*EXAMPLE, "--loggra-sketch", "gradient", *bad])
        assert e.value.code == 2
    capsys.readouterr()


def test_frozen_non_targets_have_no_gradient_master_or_optimizer_state(cli, capsys):
    """``--freeze-non-targets``: the dense rest (embeddings, output layer, norms) keeps its
    bf16 weights only; what is left is the targets' masters and row moments."""
    totals = {}
    for frozen in (False, True):
        assert cli.main([*EXAMPLE, *(["--freeze-non-targets"] if frozen else []), "--json"]) == 0
        totals[frozen] = json.loads(capsys.readouterr().out)["loggra"]
    free, frozen = totals[False], totals[True]
    assert free["grads"] > 0 == frozen["grads"]
    assert frozen["weights"] == free["weights"] and frozen["sketch_buffer"] == free["sketch_buffer"]
    assert frozen["master_params"] < free["master_params"]
    assert frozen["optimizer_state"] < free["optimizer_state"]


FIT = [
    *("--fit", "--hf-config", CONFIG_27B, "--num-nodes", "1", "--gpu-memory-gb", "79.1"),
    *("--bf16", "--seq-length", "4096", "--max-new-tokens", "3072", "--loggra-rank", "128"),
]


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--loggra-sketch", "forward"),
        ("--loggra-row-optimizer", "lion"),
        ("--loggra-targets", "linear_qkv,linear_qkv"),
        ("--loggra-targets", "output_layer"),
    ],
)
def test_invalid_settings_name_their_flag(cli, capsys, flag, value):
    backward = [] if flag == "--loggra-sketch" else ["--loggra-sketch", "backward"]
    with pytest.raises(SystemExit) as e:
        cli.main([*EXAMPLE, *backward, flag, value])
    assert e.value.code == 2 and names_flag(capsys.readouterr().err, flag)


def test_fit_searches_with_the_backward_sketch(cli, capsys):
    backward = ["--loggra-sketch", "backward"]
    assert cli.main([*FIT, *backward, "--json"]) == 0
    bwd = json.loads(capsys.readouterr().out)
    assert cli.main([*FIT, "--loggra-sketch", "gradient", "--json"]) == 0
    grad = json.loads(capsys.readouterr().out)
    assert cli.main([*FIT, "--json"]) == 0  # the default mode is the backward sketch
    assert json.loads(capsys.readouterr().out)["loggra"] == bwd["loggra"]
    assert bwd["loggra_sketch"] == "backward" and grad["loggra_sketch"] == "gradient"
    assert bwd["loggra"]["fit"] >= grad["loggra"]["fit"] > 0
    assert bwd["adam"] == grad["adam"]  # the dense column ignores the mode
    # a printed configuration is what the estimator prints for its flags
    best = bwd["loggra"]["best"][0]
    run = [a for a in FIT if a not in ("--fit", "--num-nodes", "1")]
    assert cli.main([*run, "--world-size", "8", *backward, *best["flags"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loggra"]["total"] == pytest.approx(best["total"])
    assert cli.main([*FIT, *backward, "--fit-top", "1"]) == 0
    assert "LoGRA (--optimizer loggra --loggra-sketch backward)" in capsys.readouterr().out


# ---------------------------------------------------------------------- the benchmark
BENCH = os.path.join(ROOT, "benchmarks", "memory_dp_scaling.py")


def test_docs_quote_the_benchmark_output():
    """docs/memory.md's ``$ python benchmarks/memory_dp_scaling.py`` block is its output."""
    docs = read(os.path.join(ROOT, "docs", "memory.md"))
    blocks = re.findall(
        r"^```\n\$ python benchmarks/memory_dp_scaling\.py(.*?)\n(.*?)^```", docs, re.S | re.M
    )
    assert len(blocks) == 1
    extra, shown = blocks[0]
    out = subprocess.run(
        [sys.executable, BENCH, *extra.split()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == shown
    # the per-GPU numbers the text quotes are the benchmark's
    section = docs.split("## The backward sketch", 1)[1].split("\n## ", 1)[0]
    numbers = set(re.findall(r"(?<![\d.])\d+\.\d\d(?![\d.])", out))
    quoted = re.findall(r"(?<![\d.])\d+\.\d\d(?![\d.])", section.replace(shown, ""))
    assert quoted and set(quoted) <= numbers


def test_the_benchmark_is_the_estimator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_dp_scaling", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.run(bench.parse_args(["--dp", "2"]))
    (row,) = result["rows"]
    assert row["gpus"] == 16
    # each arm sets its own --loggra-sketch over the script's flags (the script runs backward)
    flags = bench.script_flags(os.path.join(ROOT, bench.SCRIPT))
    assert flags[flags.index("--loggra-sketch") + 1] == "backward" and "$@" not in flags
    assert "--loggra-update-interval" in bench.gradient_only_flags()
    assert "--loggra-rank" not in bench.gradient_only_flags()
    assert row["backward"].total_bytes < row["gradient"].total_bytes < row["adam"].total_bytes
    assert row["backward"].grads < row["gradient"].grads
    own = result["example"]["backward"]
    quoted = bench.as_json(result)["example"]["backward"]["total"]
    assert quoted == own.total_bytes / GiB and own.sketch_buffer > 0
    assert result["example"]["gradient"].sketch_buffer == 0


# ---------------------------------------------------------------------- real runs
def _measure(rank, bf16=False, remainders=False, reduce="step"):
    """A tiny GPT with the backward sketch after one step: its buffer, state, masters and
    grad buffer in bytes (tests/helpers/backward_sketch_runs.py builds it)."""
    import torch
    from backward_sketch_runs import TOKENS, build_sketched, local_batch, settings

    from loggra_megatron.optim import state_bytes
    from loggra_megatron.testing import train_step

    kw = {"loggra_param_remainders": True} if remainders else {}
    optim, loggra = settings(loggra_sketch_reduce=reduce, **kw)
    ddp, opt = build_sketched(optim, loggra, bf16=bf16)
    batch, micro = local_batch(TOKENS)
    _, (ok, _, _) = train_step(ddp, opt, batch, num_microbatches=micro)
    assert ok
    from loggra_megatron.optim.megatron.params import shares_storage

    leaf = opt.chained_optimizers[-1]
    (sites,) = leaf.sites
    signs = sites.signs_cache_bytes()  # the step dropped the update's projections
    for site in sites:  # what an update's forwards keep of them
        sites.signs(site)
    masters = 0
    for main, (_, site, _, _) in leaf.rows_of.items():
        if main in leaf.optimizer.param_remainders:
            masters += leaf.optimizer.param_remainders[main].nbytes
        elif not shares_storage(main, site.weight):
            masters += main.nbytes  # a separate fp32 copy of the rows
    in_buffers = any(s.weight in b.param_index_map for s in sites for b in ddp.buffers)
    return {
        "buffer": sites.buffer.nbytes,
        "signs": (signs, sites.signs_cache_bytes()),
        "rank": sites.rank,
        "row_state": state_bytes(leaf),
        "state": state_bytes(opt),
        "masters": masters,
        "grad_buffer": sum(b.grad_data.nbytes for b in ddp.buffers),
        "targets_in_grad_buffers": in_buffers,
        "rows": sum(hi - lo for _, _, lo, hi in leaf.rows_of.values()),
        "fp32": torch.float32 in {s.weight.dtype for s in sites},
    }


def _estimate(dp, bf16, remainders, reduce="step"):
    from backward_sketch_runs import HEADS, HIDDEN, RANK, VOCAB

    shape = TransformerShape(
        num_layers=2,
        hidden_size=HIDDEN,
        ffn_hidden_size=2 * HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        untie_embeddings_and_output_weights=True,
        make_vocab_size_divisible_by=1,
    )
    step = _step(
        dp,
        loggra_rank=RANK,
        precision="bf16" if bf16 else "fp32",
        loggra_param_remainders=remainders,
        loggra_sketch_reduce=reduce,
    )
    params = stage_parameters(shape, step)
    targets, dense = _split(params)
    return estimate_rl_step_memory(shape, step), targets, dense


@pytest.mark.parametrize(
    "dp,bf16,remainders,reduce",
    [
        (1, False, False, "step"),
        (1, True, False, "step"),
        (2, False, False, "step"),
        (2, True, True, "step"),
        (2, True, True, "microbatch"),
    ],
)
def test_estimate_matches_a_real_megatron_run(dp, bf16, remainders, reduce):
    got = run_distributed(_measure, dp, bf16=bf16, remainders=remainders, reduce=reduce)
    est, targets, dense = _estimate(dp, bf16, remainders, reduce)
    row_state = bs.row_state_bytes(targets, dp, "adam")
    for r in got:
        # [DP, Σ⌈m/DP⌉, r] fp32 on every rank; [1, …] reduced per micro-batch
        assert r["buffer"] == est.sketch_buffer
        assert r["signs"] == (0, bs.signs_cache_bytes(targets, 8))  # 1 bit per entry of B
        assert r["rank"] == 8
        assert not r["targets_in_grad_buffers"]
    # RowAdam's exp_avg_sq: 4 bytes per owned row; the ranks' rows partition every weight
    assert sum(r["rows"] for r in got) == sum(p.shape[0] for p in targets)
    assert max(r["row_state"] for r in got) == row_state
    assert sum(r["row_state"] for r in got) == 4 * sum(p.shape[0] for p in targets)
    # the targets' masters: the fp32 weights themselves, fp32 row copies or int16 remainders
    per_master = 0 if not bf16 else 2 if remainders else 4
    assert max(r["masters"] for r in got) == est.master_params - master_param_bytes(
        dense, dp, per_master
    )
    # the dense leaves' AdamW: exact at DP = 1, Megatron's bucket split within 10 % at DP = 2
    dense_state = est.optimizer_state - row_state
    for r in got:
        if dp == 1:
            assert r["state"] - r["row_state"] == dense_state
        else:
            assert abs(r["state"] - r["row_state"] - dense_state) <= 0.1 * dense_state
    # the grad buffer holds the dense parameters (up to Megatron's alignment padding, less
    # than the smallest target's fp32 bytes) and no target
    smallest = 4 * min(p.numel for p in targets)
    for r in got:
        assert est.grads <= r["grad_buffer"] < est.grads + smallest
