"""When the dynamic engine's decode steps become CUDA graphs (``rollout.dynamic.mcore_engine``,
``rollout.dynamic.generate``): the decisions that need no engine. The graphs themselves run
in ``tests/integration/test_rollout_dynamic.py`` through Megatron's own graph manager."""

from __future__ import annotations

import contextlib
import dataclasses
import types
import warnings

import pytest

import loggra_megatron.rollout.dynamic.generate as dynamic
from loggra_megatron.rollout.dynamic import mcore_engine
from loggra_megatron.rollout.dynamic.mcore_engine import EnginePlan, graph_register_hazard

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_graph_register_hazard_is_megatrons_condition():
    """Megatron-Core 0.16's manager asserts ``NCCL_GRAPH_REGISTER=0`` beside expandable
    segments (before Blackwell; this machine has no GPU, so capability 0)."""
    assert graph_register_hazard({}) is None
    assert graph_register_hazard({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None
    assert graph_register_hazard({**EXPANDABLE, "NCCL_GRAPH_REGISTER": "0"}) is None
    for env in (EXPANDABLE, {**EXPANDABLE, "NCCL_GRAPH_REGISTER": "1"}):
        assert "export NCCL_GRAPH_REGISTER=0" in graph_register_hazard(env)


def _config(fp8=None):
    return types.SimpleNamespace(fp8=fp8, cuda_graph_impl="none")


def test_decode_graphs_only_when_wanted_safe_and_not_fp8(monkeypatch):
    attached = []

    @contextlib.contextmanager
    def fake_graphs(model, config):
        attached.append(model)
        yield

    monkeypatch.setattr(mcore_engine, "decode_graphs", fake_graphs)
    monkeypatch.setattr(dynamic, "_warn_once", dynamic._warn_once.__wrapped__)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    for wanted, fp8 in ((False, None), (True, "e4m3")):
        with dynamic._decode_graphs("model", _config(fp8), wanted):
            pass
    assert attached == []
    with dynamic._decode_graphs("model", _config(), True):
        pass
    assert attached == ["model"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    warns = pytest.warns(RuntimeWarning, match="NCCL_GRAPH_REGISTER=0")
    with warns, dynamic._decode_graphs("model", _config(), True):
        pass
    assert attached == ["model"]  # eager, said


def test_context_graph_sizes_only_inside_decode_graphs():
    """Graph-sized batches without managers would only pad; on 0.16 fewer requests than TP
    would make a graph of 0 tokens."""
    plan = EnginePlan(
        blocks=4, max_requests=4, step_tokens=64, max_seq=32, block_size=256, cuda_graphs=16
    )
    local = types.SimpleNamespace(cuda_graph_impl="local")
    assert mcore_engine._graph_sizes(_config(), plan, 1) is None
    assert mcore_engine._graph_sizes(local, plan, 1) == 16
    few = dataclasses.replace(plan, max_requests=1)
    want = 16 if mcore_engine.has_inference_config() else None
    assert mcore_engine._graph_sizes(local, few, 2) == want


def test_warn_once_says_it_once():
    dynamic._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            dynamic._warn_once("unit-test message")
    assert [str(w.message) for w in caught] == ["unit-test message"]
