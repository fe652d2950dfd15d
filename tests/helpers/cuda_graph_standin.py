"""CUDA graphs on CPU: ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph`` that record a capture
and replay it as a GPU would, so Megatron-Core's own ``CudaGraphManager`` runs on CPU.

What a CUDA graph does, and what ``RecordedGraph`` therefore does:

* **A capture records kernels, not Python.** Every ATen operator run inside
  ``torch.cuda.graph(g)`` is recorded (through a ``TorchDispatchMode``) with the tensor objects
  it read and wrote. ``replay()`` runs the recorded operators again on *those* tensors: values
  refilled in place before a replay are seen, while a Python value read at capture, a tensor
  rebound since, or a buffer freed and reallocated elsewhere is not (the replay reads the
  captured one: on a GPU, stale memory). Results are written into the captured outputs, and
  ops that only made views are not re-run (they alias memory the replay refills anyway).
* **No host reads inside a capture.** ``.item()``, ``bool(t)``, ``nonzero``, boolean-mask
  indexing: the capture raises (CUDA: ``cudaErrorStreamCaptureUnsupported``), with
  ``rollout.static.step_graph``'s list of such operators.
* **Collectives replay.** A TP all-reduce inside a layer (``torch.distributed``'s
  ``COLLECTIVES``, which do not pass the dispatcher) is recorded in order with the operators
  and re-run at every replay, as NCCL kernels are part of a graph.
* **One stream.** ``torch.cuda.set_stream``/``current_stream`` are tracked, so a test sees
  the stream a graph manager leaves current.

``install()`` puts them in ``torch.cuda`` (after ``loggra_megatron.cpu``'s CPU mode) with what
Megatron's graph code also calls there (a graph pool handle, the default generators with
graph-safe state calls, memory statistics); ``live_graphs()`` counts graphs not yet freed.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loggra_megatron.rollout.static.step_graph import HostReadError, reads_host

_LIVE: weakref.WeakSet = weakref.WeakSet()
_CAPTURING: list[RecordedGraph] = []
_POOLS = itertools.count(1)
COUNTS = {"captures": 0, "replays": 0}
"""Graphs captured and replays run in this process."""


def _storages(tree) -> set[int]:
    return {
        t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
    }


def _is_view(func, args, kwargs, out) -> bool:
    """The op only made views of its inputs: no new values to replay. Decided by memory, not
    by the schema (``aten::to``, ``reshape``, ``contiguous`` are declared aliasing and copy
    when they must)."""
    if func._schema.is_mutable:
        return False
    outs = _storages(out)
    return bool(outs) and outs <= _storages((args, kwargs))


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if reads_host(name, args):
            raise HostReadError(
                f"{name} inside a CUDA graph capture: operation not permitted when stream is "
                "capturing (cudaErrorStreamCaptureUnsupported)"
            )
        out = func(*args, **kwargs)
        if not _is_view(func, args, kwargs, out):
            self.graph.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """``torch.cuda.CUDAGraph`` on CPU (see the module docstring)."""

    def __init__(self, keep_graph: bool = False):
        self.ops: list = []
        self.captured = False
        self._pool = None
        self._mode: _Recorder | None = None
        _LIVE.add(self)

    def register_generator_state(self, generator) -> None:
        """Generators whose state a replay advances (a CPU replay draws afresh anyway)."""

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        if self.captured or _CAPTURING:
            raise RuntimeError("a CUDA graph capture is already under way or done for this graph")
        self._pool = pool if pool is not None else ("pool", next(_POOLS))
        self._mode = _Recorder(self)
        self._mode.__enter__()
        _CAPTURING.append(self)

    def capture_end(self) -> None:
        _CAPTURING.remove(self)
        self._mode.__exit__(None, None, None)
        self._mode, self.captured = None, True
        COUNTS["captures"] += 1

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay of a CUDA graph that was not captured")
        if _CAPTURING:
            raise RuntimeError("a CUDA graph replayed inside another's capture")
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            if out is None:  # a collective: in place
                if hasattr(fresh, "wait"):
                    fresh.wait()
                continue
            for new, old in zip(tree_leaves(fresh), tree_leaves(out), strict=True):
                if isinstance(new, torch.Tensor) and new is not old:
                    old.copy_(new)
        COUNTS["replays"] += 1

    def reset(self) -> None:
        self.ops, self.captured = [], False

    def pool(self):
        return self._pool


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
"""``torch.distributed`` calls recorded into a capture (in-place on their tensors)."""


def _recorded(collective):
    def call(*args, **kwargs):
        out = collective(*args, **kwargs)
        if _CAPTURING:
            _CAPTURING[-1].ops.append((collective, args, kwargs, None))
        return out

    call.standin_of = collective
    return call


class graph(contextlib.AbstractContextManager):  # noqa: N801 (torch.cuda.graph's name)
    """``torch.cuda.graph``: capture what runs inside into ``cuda_graph``."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.cuda_graph, self.pool, self.mode = cuda_graph, pool, capture_error_mode

    def __enter__(self):
        self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.mode)

    def __exit__(self, *exc):
        self.cuda_graph.capture_end()
        return False


class _GraphSafeGenerator:
    """The CUDA default generator's graph-safe state calls, on the CPU generator."""

    def graphsafe_get_state(self):
        return torch.default_generator.get_state()

    def graphsafe_set_state(self, state) -> None:
        torch.default_generator.set_state(state)

    get_state, set_state = graphsafe_get_state, graphsafe_set_state


class _Streams:
    """The current stream, tracked (the CPU mode's ``set_stream`` forgets it)."""

    def __init__(self):
        self.current = torch.cuda.current_stream()

    def current_stream(self, device=None):
        return self.current

    def set_stream(self, stream) -> None:
        self.current = stream


_MEMORY_STATS = {
    f"{kind}_bytes.all.{when}": 0
    for kind in ("reserved", "allocated", "active")
    for when in ("current", "peak")
}


def install() -> _Streams:
    """Put the stand-ins into ``torch.cuda`` (this process, after the CPU mode); returns the
    stream tracker."""
    streams = _Streams()
    generator = _GraphSafeGenerator()
    for name, value in {
        "CUDAGraph": RecordedGraph,
        "graph": graph,
        "graph_pool_handle": lambda: ("pool", next(_POOLS)),
        "is_current_stream_capturing": lambda: bool(_CAPTURING),
        "default_generators": (generator,),
        "device_count": lambda: 1,
        "current_stream": streams.current_stream,
        "set_stream": streams.set_stream,
        "empty_cache": lambda: None,
        "memory_stats": lambda device=None: dict(_MEMORY_STATS),
        "memory_snapshot": lambda: [],
    }.items():
        setattr(torch.cuda, name, value)
    for name in COLLECTIVES:
        collective = getattr(torch.distributed, name)
        setattr(torch.distributed, name, _recorded(getattr(collective, "standin_of", collective)))
    return streams


def live_graphs() -> list[RecordedGraph]:
    """Graphs captured and not yet freed (``gc`` first: a cycle may hold a runner)."""
    gc.collect()
    return [g for g in _LIVE if g.captured]
