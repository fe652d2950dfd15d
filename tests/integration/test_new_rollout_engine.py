"""The rollout-engine recipe of docs/architecture.md, tried: a new ``--rollout-engine`` (the
static engine, counted, with a double-buffered KV cache) is one module plus one registry line.
In-tree, as a developer adds it (a copy of the package with ``rollout/counting.py`` and its
line in ``rollout/registry.py``): every entry point imports without a cycle, the flag offers
it, start-up refuses it where its entry says it cannot run and the estimator counts its KV
cache. Registered at run time (in-process, fast): ``auto`` prefers it by its priority,
``ExperienceMaker`` runs it (weight sync, generation, the logged stats) and the memory model
counts its KV cache.
"""

import importlib.util
import json
import os
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loggra_megatron.rollout.registry import ROLLOUT_ENGINES
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

ENGINE_MODULE = '''
"""The static engine, counted, with a double-buffered KV cache (one engine module)."""

from loggra_megatron.rollout.static import StaticEngine


class CountingEngine(StaticEngine):
    name = "counting"
    description = "the static engine, counted, with a double-buffered KV cache"
    auto_priority = 2  # auto takes it over the static and the dynamic engine
    calls = {"sync": 0, "generate": 0}

    def refusal(self, target):
        return None if target.half else "it samples in bf16 only: add --bf16"

    def sync_weights(self, policy):
        self.calls["sync"] += 1

    def generate(self, policy, prompts, request):
        self.calls["generate"] += 1
        return super().generate(policy, prompts, request)

    def kv_cache_tokens(self, step):
        return 2 * super().kv_cache_tokens(step)
'''


@pytest.fixture
def engine_dir(tmp_path, monkeypatch):
    """The engine module in a temporary directory, and its entry in the registry."""
    (tmp_path / "counting_engine.py").write_text(textwrap.dedent(ENGINE_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import counting_engine

    monkeypatch.setitem(ROLLOUT_ENGINES, "counting", counting_engine.CountingEngine())
    return str(tmp_path)


def _experience(rank, engine_dir, tokenizer):
    """One RL step's experience with ``--rollout-engine auto`` and ``static``."""
    from rl_runs import tiny_argv, tiny_policy

    from loggra_megatron.train.build import experience_maker

    sys.path.insert(0, engine_dir)
    import counting_engine

    ROLLOUT_ENGINES["counting"] = counting_engine.CountingEngine()  # the registry line
    cfg, host, policy, examples = tiny_policy(tiny_argv(tokenizer, bf16=True))
    out = {}
    for name in ("auto", "static"):
        cfg.rollout.rollout_engine = name
        maker = experience_maker(cfg, host, policy, None)
        exp = maker.make(examples, step=0)
        out[name] = {
            "engine": maker.engine.name,
            "note": maker.engine_note,
            "tokens": exp.tokens,
            "metrics": exp.metrics,
        }
    out["calls"] = dict(counting_engine.CountingEngine.calls)
    return out


def test_a_new_rollout_engine_runs_through_the_experience_maker(engine_dir, tokenizer):
    (out,) = run_distributed(_experience, 1, engine_dir, tokenizer)
    assert out["auto"]["engine"] == "counting"
    assert out["auto"]["note"].startswith("--rollout-engine auto: counting (")
    assert out["static"]["engine"] == "static"
    assert out["calls"] == {"sync": 1, "generate": 1}  # synced before it generated
    assert torch.equal(out["auto"]["tokens"], out["static"]["tokens"])
    counted, static = out["auto"]["metrics"], out["static"]["metrics"]
    for key in ("reward/mean", "reward/accuracy", "memory/kv_cache_bytes"):
        assert counted[key] == static[key], key
    assert counted["time/rollout_s"] > 0 and counted["throughput/rollout_tokens_per_s"] > 0


def test_start_up_refuses_it_where_its_entry_says_it_cannot_run(engine_dir, tokenizer, capsys):
    from rl_runs import refused, tiny_argv

    from loggra_megatron.arguments import parse_args

    argv = tiny_argv(tokenizer, **{"rollout-engine": "counting"})
    refused(argv, capsys, "--rollout-engine", "counting", "add --bf16")
    assert parse_args([*argv, "--bf16"], world_size=2).rollout.rollout_engine == "counting"
    refused(tiny_argv(tokenizer, **{"rollout-engine": "paged"}), capsys, "counting")  # a choice


def test_the_memory_model_and_the_estimator_count_its_kv_cache(engine_dir, capsys):
    from memory_plans import plan

    from loggra_megatron.memory.model import TransformerShape, estimate_rl_step_memory

    shape = TransformerShape(
        num_layers=4, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, vocab_size=32000
    )
    step = plan(seq_length=1024, max_new_tokens=512, rollout_batch_size=16)
    est = {
        name: estimate_rl_step_memory(shape, replace(step, rollout_engine=name))
        for name in ("counting", "static")
    }
    assert est["counting"].kv_cache == 2 * est["static"].kv_cache > 0
    assert est["counting"].prefill_activations == est["static"].prefill_activations
    assert est["counting"].old_log_prob_activations == 0  # log-probs sampled while decoding

    spec = importlib.util.spec_from_file_location(
        "estimate_memory_cli",
        os.path.join(str(Path(__file__).resolve().parents[2]), "tools", "estimate_memory.py"),
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    shape_flags = {
        "num-layers": 4,
        "hidden-size": 512,
        "ffn-hidden-size": 1408,
        "num-attention-heads": 8,
        "vocab-size": 32000,
    }
    flags = [f"--{k}={v}" for k, v in shape_flags.items()]
    flags += ["--seq-length=1024", "--prompts-per-step=4", "--num-generations=4", "--bf16"]
    flags += ["--json"]
    kv = {}
    for name in ("counting", "static", "auto"):
        assert cli.main([*flags, "--rollout-engine", name]) == 0
        kv[name] = json.loads(capsys.readouterr().out)["loggra"]["kv_cache"]
    assert kv["counting"] == 2 * kv["static"] > 0
    assert kv["auto"] == kv["counting"]  # auto takes the engine of highest priority


def test_in_tree_the_engine_is_one_module_and_one_registry_line(tokenizer, tmp_path):
    from package_copy import package_copy, run_in
    from rl_runs import tiny_argv

    static = "from loggra_megatron.rollout.static import StaticEngine\n"
    tree = package_copy(
        tmp_path,
        {"loggra_megatron/rollout/counting.py": textwrap.dedent(ENGINE_MODULE)},
        [
            (
                "loggra_megatron/rollout/registry.py",
                static,
                static + "from loggra_megatron.rollout.counting import CountingEngine\n",
            ),
            (
                "loggra_megatron/rollout/registry.py",
                '    "dynamic": DynamicEngine(),\n',
                '    "dynamic": DynamicEngine(),\n    "counting": CountingEngine(),\n',
            ),
        ],
    )
    # each module first in a fresh interpreter: an import cycle through the registry fails here
    for module in (
        "loggra_megatron.rollout.counting",
        "loggra_megatron.rollout.registry",
        "loggra_megatron.memory.model",
        "loggra_megatron.rl.experience",
        "loggra_megatron.arguments",
    ):
        done = run_in(tree, "-c", f"import {module}")
        assert done.returncode == 0, (module, done.stderr[-2000:])
    pretrain = str(tree / "pretrain_rl.py")
    argv = [str(a) for a in tiny_argv(tokenizer, **{"rollout-engine": "counting"})]
    refused = run_in(tree, pretrain, *argv)
    assert refused.returncode == 2 and "add --bf16" in refused.stderr
    refused = run_in(tree, pretrain, *argv[:-2], "--rollout-engine", "paged")  # the choices
    assert refused.returncode == 2 and "counting" in refused.stderr.splitlines()[-1]
    estimate = str(tree / "tools" / "estimate_memory.py")
    flags = ["--num-layers=4", "--hidden-size=512", "--ffn-hidden-size=1408"]
    flags += ["--num-attention-heads=8", "--vocab-size=32000", "--seq-length=1024"]
    flags += ["--prompts-per-step=4", "--num-generations=4", "--bf16", "--json"]
    kv = {}
    for name in ("counting", "static"):
        done = run_in(tree, estimate, *flags, "--rollout-engine", name)
        assert done.returncode == 0, done.stderr[-2000:]
        kv[name] = json.loads(done.stdout)["loggra"]["kv_cache"]
    assert kv["counting"] == 2 * kv["static"] > 0
