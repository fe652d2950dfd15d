"""The optimizer recipe of docs/architecture.md, tried: a new ``--optimizer`` variant (SGD with
momentum inside Megatron's optimizer) is one builder module plus one registry entry. In-tree,
as a developer adds it (a copy of the package with ``optim/megatron/sgd_momentum.py`` and its
entry in ``optim/registry.py``): every entry point imports without a cycle, start-up refuses
what its entry says it cannot do and the estimator counts its state. Registered at run time
(in-process, fast): it trains and resumes bitwise through the real checkpoint code at DP=2,
start-up refuses what its entry says it cannot do (exit 2, naming the flag), and the memory
model counts its state.
"""

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from loggra_megatron.optim.registry import OPTIMIZERS, OptimizerSpec
from loggra_megatron.testing import run_distributed, tiny_bf16_gpt_model, tiny_gpt_model

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

LAST_ENTRY = (
    '        prepare_model="loggra_megatron.optim.megatron.factory:prepare_model",\n    ),\n'
)
"""The end of ``OPTIMIZERS``' last entry, where the developer adds theirs."""

BUILDER_MODULE = '''
"""SGD with momentum inside Megatron-Core's optimizer (one builder module)."""

import dataclasses

import torch
from megatron.core.optimizer import get_megatron_optimizer

from loggra_megatron.optim.megatron.factory import megatron_optimizer_config


def build_sgd_momentum(optim, loggra, model_chunks, prepared):
    config = megatron_optimizer_config(optim, model_chunks)
    config = dataclasses.replace(config, optimizer="sgd", sgd_momentum=0.9)
    return get_megatron_optimizer(config, model_chunks)


def init_momentum(optimizer, config=None):
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
'''

SGD_MOMENTUM = OptimizerSpec(
    "sgd_momentum",
    "SGD with momentum 0.9 (Megatron's SGD)",
    "sgd_momentum:build_sgd_momentum",
    sketched=False,
    grads_per_weight=False,
    distributed=False,  # Megatron's DistributedOptimizer takes Adam only
    candidate=False,  # no side-effect-free candidate: predicted-KL control is refused
    state_bytes_per_param=4,  # the momentum buffer
    init_state="sgd_momentum:init_momentum",
)
ESTIMATOR = os.path.join(str(Path(__file__).resolve().parents[2]), "tools", "estimate_memory.py")
VOCAB, SEQ = 64, 8
TOKENS = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def builder_dir(tmp_path, monkeypatch):
    """The builder module in a temporary directory, and the entry in the registry."""
    (tmp_path / "sgd_momentum.py").write_text(textwrap.dedent(BUILDER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(OPTIMIZERS, "sgd_momentum", SGD_MOMENTUM)
    return str(tmp_path)


def _train(rank, builder_dir, bf16, steps, save=None, load=None):
    """``steps`` steps of this DP rank's rows with the registered variant, saving after step
    ``save[1]`` into ``save[0]`` or starting from the checkpoint ``load``."""
    from megatron.core import parallel_state

    from loggra_megatron.checkpointing import load_checkpoint, save_checkpoint
    from loggra_megatron.memory.model import ParamSpec, optimizer_state_bytes
    from loggra_megatron.optim import state_bytes
    from loggra_megatron.optim.config import LoGRAConfig, OptimConfig
    from loggra_megatron.optim.megatron.factory import build_optimizer
    from loggra_megatron.testing import train_step, wrap_ddp

    sys.path.insert(0, builder_dir)
    OPTIMIZERS["sgd_momentum"] = SGD_MOMENTUM  # the registry line, at run time
    shape = dict(num_layers=2, hidden_size=32, heads=4, vocab=VOCAB, seq=SEQ)
    model = tiny_bf16_gpt_model(**shape) if bf16 else tiny_gpt_model(**shape)
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    optim = OptimConfig(optimizer="sgd_momentum", lr=0.05, use_distributed_optimizer=False)
    opt = build_optimizer(OPTIMIZERS["sgd_momentum"], optim, LoGRAConfig(), [ddp])
    if load is not None:
        load_checkpoint(load, [ddp], opt)
    dp, dp_rank = (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
    )
    batch = TOKENS[dp_rank::dp]
    losses = []
    for step in range(steps):
        loss, (ok, _, _) = train_step(ddp, opt, batch, num_microbatches=batch.shape[0])
        assert ok
        losses.append(loss)
        if save is not None and step + 1 == save[1]:
            save_checkpoint(save[0], step + 1, [ddp], opt, common={"step": step + 1})
    inner = opt.optimizer
    params = [ParamSpec(n, tuple(p.shape), "linear") for n, p in ddp.module.named_parameters()]
    return {
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "losses": losses,
        "inner": type(inner).__name__,
        "momentum": sum(float(s["momentum_buffer"].abs().sum()) for s in inner.state.values()),
        "state_bytes": state_bytes(opt),
        "estimated_state_bytes": optimizer_state_bytes(params, "sgd_momentum"),
    }


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_new_optimizer_variant_trains_saves_and_resumes_exactly(builder_dir, tmp_path, bf16):
    full = run_distributed(_train, 2, builder_dir, bf16, 4)
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 2, builder_dir, bf16, 2, save=(ckpt, 2))
    resumed = run_distributed(_train, 2, builder_dir, bf16, 2, load=ckpt)
    for r in range(2):
        assert full[r]["inner"] == "SGD" and full[r]["momentum"] > 0
        assert full[r]["losses"][-1] < full[r]["losses"][0]
        assert resumed[r]["losses"] == full[r]["losses"][2:]
        for name, value in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][name], value), name
        # the memory model counts its state (one fp32 buffer per parameter), not Adam's
        assert full[r]["state_bytes"] == full[r]["estimated_state_bytes"] > 0


def test_start_up_refuses_what_the_entry_says_it_cannot_do(builder_dir, tokenizer, capsys):
    from rl_runs import refused, tiny_argv

    from loggra_megatron.arguments import parse_args

    argv = tiny_argv(tokenizer, optimizer="sgd_momentum")
    refused(argv, capsys, "--use-distributed-optimizer", "sgd_momentum")
    local = tiny_argv(tokenizer, optimizer="sgd_momentum", **{"no-use-distributed-optimizer": True})
    assert parse_args(local, world_size=2).optimizer.optimizer == "sgd_momentum"
    controlled = [*local, "--bf16", "--kl-target", "0.05"]
    refused(controlled, capsys, "--kl-target", "sgd_momentum", "candidate")
    adam = parse_args([*controlled, "--optimizer", "adam"], world_size=2)
    assert adam.kl_control.enabled  # what is refused is the optimizer's, not the flag's


def test_the_memory_model_and_the_estimator_count_its_state(builder_dir, capsys):
    from memory_plans import plan

    from loggra_megatron.memory.model import (
        GiB,
        TransformerShape,
        estimate_rl_step_memory,
        stage_parameters,
    )

    shape = TransformerShape(
        num_layers=4, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, vocab_size=32000
    )
    parallel = plan(data_parallel_size=2)
    numel = sum(p.numel for p in stage_parameters(shape, parallel))
    state = {}
    for name in ("sgd_momentum", "adam"):
        step = plan(data_parallel_size=2, optimizer=name, distributed_optimizer=False)
        state[name] = estimate_rl_step_memory(shape, step).optimizer_state
    assert state["sgd_momentum"] == 4 * numel  # one fp32 momentum per element, no step
    assert state["adam"] > 2 * state["sgd_momentum"]

    spec = importlib.util.spec_from_file_location("estimate_memory_cli", ESTIMATOR)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    shape_flags = ["--num-layers=4", "--hidden-size=512", "--ffn-hidden-size=1408"]
    shape_flags += ["--num-attention-heads=8", "--vocab-size=32000", "--world-size=2"]
    run = [*shape_flags, "--optimizer", "sgd_momentum", "--no-use-distributed-optimizer"]
    assert cli.main([*run, "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["sgd_momentum"]["optimizer_state"] * GiB == state["sgd_momentum"]
    assert cli.main(run) == 0
    assert "sgd_momentum*: optimizer state" in capsys.readouterr().out


def test_in_tree_the_variant_is_one_module_and_one_registry_entry(tokenizer, tmp_path):
    from package_copy import package_copy, run_in
    from rl_runs import tiny_argv

    module = "loggra_megatron.optim.megatron.sgd_momentum"
    entry = f"""    "sgd_momentum": OptimizerSpec(
        "sgd_momentum",
        "SGD with momentum 0.9 (Megatron's SGD)",
        "{module}:build_sgd_momentum",
        sketched=False,
        grads_per_weight=False,
        distributed=False,
        candidate=False,
        state_bytes_per_param=4,
        init_state="{module}:init_momentum",
    ),
}}
"""
    tree = package_copy(
        tmp_path,
        {"loggra_megatron/optim/megatron/sgd_momentum.py": textwrap.dedent(BUILDER_MODULE)},
        [("loggra_megatron/optim/registry.py", f"{LAST_ENTRY}}}\n", LAST_ENTRY + entry)],
    )
    for name in (module, "loggra_megatron.optim.registry", "loggra_megatron.arguments"):
        done = run_in(tree, "-c", f"import {name}")
        assert done.returncode == 0, (name, done.stderr[-2000:])
    pretrain = str(tree / "pretrain_rl.py")
    argv = [str(a) for a in tiny_argv(tokenizer, optimizer="sgd_momentum")]
    refused = run_in(tree, pretrain, *argv, "--kl-target", "0.01")  # no candidate step
    assert refused.returncode == 2 and "--kl-target" in refused.stderr
    refused = run_in(tree, pretrain, *argv, "--use-distributed-optimizer")
    assert refused.returncode == 2 and "--use-distributed-optimizer" in refused.stderr
    estimate = str(tree / "tools" / "estimate_memory.py")
    shape = ["--num-layers=2", "--hidden-size=256", "--ffn-hidden-size=512"]
    shape += ["--num-attention-heads=4", "--vocab-size=1000", "--seq-length=256", "--json"]
    run = [*shape, "--optimizer", "sgd_momentum", "--no-use-distributed-optimizer"]
    done = run_in(tree, estimate, *run)
    assert done.returncode == 0, done.stderr[-2000:]
    table = json.loads(done.stdout)
    assert 0 < table["sgd_momentum"]["optimizer_state"] < table["adam"]["optimizer_state"]
