"""One decode step captured once and replayed: CUDA graphs on a GPU, the same contract on CPU.

A CUDA graph records the kernels of one call of a function and replays them with no Python
and no launch overhead (gpt-fast, vLLM and Megatron-Core's inference engines decode this way).
What that asks of the function, and what ``StepGraphs`` therefore holds every step to:

* **Inputs and outputs are static tensors.** The function takes no arguments: it reads tensors
  the caller refills in place before each replay (token ids, the position), and each replay
  writes the same output tensor (the caller reads it before the next replay). A Python value
  the function reads is frozen at capture, so the key names every one (the decoder's key is
  its attention width) and the function binds them when it is made.
* **No host reads inside.** ``.item()``, ``bool(t)``, ``nonzero`` and the like synchronise
  with the host, which a capture refuses (``cudaErrorStreamCaptureUnsupported``).
* **Idempotent warm-up.** The function is run once before the capture on a side stream (what
  PyTorch asks, so lazy initialisation and cuBLAS workspaces happen outside the graph) with the
  real inputs: it must write the same values when run twice (a KV-cache write at the current
  position does).

On CUDA (``capture=True``) each key (an attention width) gets a ``torch.cuda.CUDAGraph`` with a
memory pool shared by all of them. The graphs may be replayed in any order (a chunked rollout
replays the narrow widths again for its next chunk): a step's intermediates are made and read
inside its own replay, and what outlives a replay (the output, the KV cache, the inputs) was
allocated outside the pool, so no graph reads memory another one reuses. Elsewhere the stand-in keeps
the same contract: the function is called with no arguments at every "replay", its result is
copied into the tensor the "capture" returned (so a reader of a stale output sees it change, as
on a GPU), and the "capture" runs under a dispatch mode that fails on a host read
(``HostReadError``), so a step a GPU would refuse to capture fails a CPU test first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GRAPH_RANGE", "HostReadError", "StepGraphs"]

GRAPH_RANGE = "loggra::step_graph"
"""The profiler range around each replay (what a profile counts as inside the graph)."""

HOST_READS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
        "aten::item",
        "aten::nonzero",  # and boolean-mask indexing: a data-dependent shape
        "aten::masked_select",
        "aten::is_nonzero",
        "aten::equal",
        "aten::unique_consecutive",
        "aten::_unique2",
    }
)
"""Operators that read device memory on the host (or size a result by it): never in a graph."""

MASK_INDEXED = frozenset({"aten::index", "aten::index_put", "aten::index_put_"})
"""Indexing that reads a boolean mask on the host (``t[mask]``, ``t[mask] = v``)."""


def reads_host(name: str, args) -> bool:
    if name in HOST_READS:
        return True
    if name in MASK_INDEXED:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


class HostReadError(RuntimeError):
    """A captured step read a device value on the host."""


class _RefuseHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if reads_host(name, args):
            raise HostReadError(
                f"{name} inside a captured decode step: a CUDA graph cannot capture a host "
                "read; keep the value on the device (rollout/static/step_graph.py)"
            )
        return func(*args, **(kwargs or {}))


class StepGraphs:
    """Captured steps by key; ``run`` captures a key's step on first use, then replays."""

    def __init__(self, device: torch.device, capture: bool):
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.device, self.capture = device, capture
        self._steps: dict[object, tuple[object, Callable[[], torch.Tensor], torch.Tensor]] = {}
        self._pool = None
        self.captures = 0  # graphs captured (CUDA) or steps checked at "capture" (stand-in)
        self.keys: list = []  # the keys captured, in order (kept after ``release``)

    def run(self, key, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The output of ``step`` (a function of static tensors only) under ``key``: its
        first call captures, later calls replay what was captured (not ``step`` passed
        again)."""
        if key not in self._steps:
            self._steps[key] = self._capture(step)
            self.captures += 1
            self.keys.append(key)
        graph, captured, out = self._steps[key]
        with torch.profiler.record_function(GRAPH_RANGE):
            if graph is not None:
                graph.replay()
            else:
                out.copy_(captured())
        return out

    def release(self) -> None:
        """Drops every captured graph, its step and its memory pool. A step usually holds its
        owner (a bound method or a closure over it) while the owner holds these graphs: a
        reference cycle that only Python's cyclic collector would free, long after the rollout,
        with the owner's KV cache in it. Releasing at the end of a rollout frees them at once."""
        self._steps.clear()
        self._pool = None

    def _capture(self, step):
        if not self.capture:
            with _RefuseHostReads():
                out = step()
            return None, step, out
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()  # warm-up (idempotent: the same inputs write the same values)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self._pool = graph.pool()
        return graph, step, out
