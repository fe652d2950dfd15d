"""The CUDA-graph contract of ``rollout/static/step_graph.py``, held on CPU by its stand-in."""

from __future__ import annotations

import pytest
import torch

from loggra_megatron.rollout.static.decoder import MIN_WIDTH, attention_width
from loggra_megatron.rollout.static.step_graph import HostReadError, StepGraphs


def test_replays_read_the_refilled_inputs_and_rewrite_one_output():
    graphs = StepGraphs(torch.device("cpu"), capture=False)
    x = torch.tensor([1.0, 2.0])
    out = graphs.run("w", lambda: x * 2)
    assert out.tolist() == [2.0, 4.0]
    x.copy_(torch.tensor([3.0, 5.0]))  # the caller refills the static input in place
    again = graphs.run("w", lambda: x * 100)  # a key's step is the captured one
    assert again is out and out.tolist() == [6.0, 10.0]  # stale readers see it change
    assert graphs.captures == 1


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: bool(t.any()),
        lambda t: t[t > 0],  # a data-dependent shape
        lambda t: t.nonzero(),
    ],
)
def test_a_host_read_in_a_step_fails_at_capture(read):
    graphs = StepGraphs(torch.device("cpu"), capture=False)
    x = torch.ones(3)

    def step():
        read(x)
        return x + 1

    with pytest.raises(HostReadError, match="captured decode step"):
        graphs.run(0, step)


def test_capture_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        StepGraphs(torch.device("cpu"), capture=True)


def test_attention_widths():
    assert attention_width(1, 4096) == MIN_WIDTH == 64
    assert attention_width(64, 4096) == 64
    assert attention_width(65, 4096) == 128
    assert attention_width(1000, 4096) == 1024
    assert attention_width(3000, 2500) == 2500  # never past the cache
    assert attention_width(10, 30) == 30
