"""``tests/helpers/cuda_graph_standin.py``: a recorded graph replays as a CUDA graph does, so
a rollout that would read stale memory on a GPU reads it on CPU too."""

from __future__ import annotations

import cuda_graph_standin as cg
import pytest
import torch

from loggra_megatron.rollout.static.step_graph import HostReadError


def _capture(fn):
    graph = cg.RecordedGraph()
    with cg.graph(graph):
        out = fn()
    return graph, out


def test_replay_sees_in_place_refills_not_rebinding():
    x, b = torch.ones(3), torch.full((3,), 0.5)
    inputs = {"x": x}
    graph, out = _capture(lambda: (inputs["x"] * 2 + b).to(torch.float64))
    assert out.tolist() == [2.5] * 3
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))  # refilled in place: seen
    graph.replay()
    assert out.tolist() == [2.5, 4.5, 6.5]
    inputs["x"] = torch.zeros(3)  # rebound (a new buffer): a graph still reads the old one
    graph.replay()
    assert out.tolist() == [2.5, 4.5, 6.5]


def test_copying_ops_declared_aliasing_are_replayed():
    """``aten::to``/``reshape`` are declared as aliasing but copy when they must: replayed."""
    x = torch.arange(6.0).reshape(2, 3)
    graph, out = _capture(lambda: x.t().reshape(6).to(torch.bfloat16))
    x.mul_(10)
    graph.replay()
    assert out.tolist() == [0.0, 30.0, 10.0, 40.0, 20.0, 50.0]


def test_in_place_ops_and_views_replay_in_order():
    cache, pos, val = torch.zeros(4), torch.tensor([1]), torch.tensor([7.0])
    graph, _ = _capture(lambda: cache.index_put_((pos,), val))
    pos.fill_(3)
    val.fill_(9.0)
    graph.replay()
    assert cache.tolist() == [0.0, 7.0, 0.0, 9.0]


@pytest.mark.parametrize(
    "read", [lambda t: t.sum().item(), lambda t: bool(t.any()), lambda t: t[t > 0]]
)
def test_host_reads_refuse_the_capture(read):
    t = torch.ones(3)
    with pytest.raises(HostReadError, match="cudaErrorStreamCaptureUnsupported"):
        _capture(lambda: read(t))
    assert not cg._CAPTURING  # the failed capture ended


def test_replay_before_capture_or_inside_a_capture_is_refused():
    with pytest.raises(RuntimeError, match="not captured"):
        cg.RecordedGraph().replay()
    done, _ = _capture(lambda: torch.ones(2) * 2)
    with pytest.raises(RuntimeError, match="inside another's capture"):
        _capture(done.replay)
