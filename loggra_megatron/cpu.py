"""Opt-in CPU mode that lets the *real* Megatron-Core run on CPU with the gloo backend.

Megatron-Core's model, DDP, distributed optimizer, 1F1B schedule and dist-checkpointing are
device-agnostic except for a handful of CUDA assumptions. ``enable_cpu_megatron``
redirects exactly those, and nothing else: a ``torch.overrides.TorchFunctionMode``
(``_CudaToCpuMode``) maps CUDA devices in torch calls (backward passes included) to CPU and
reports CPU tensor types under their CUDA names; CPU stand-ins replace ``torch.cuda``'s
device, stream, event, NVTX, device-property and RNG functions (restored by
``disable_cpu_megatron``; the "CUDA" RNG is the CPU default generator); and
``_MEGATRON_PATCHES`` fixes Megatron's CUDA RNG state calls. Tensors really live on CPU:
``tensor.device``, ``is_cuda`` etc. are *not* faked.

The mode lives on a per-thread stack: call ``enable_cpu_megatron`` (idempotent) in each
process -- spawned workers start clean, see ``cpu_megatron`` -- and in any extra Python
thread that runs Megatron code. It refuses to start when CUDA is available unless
``force=True``.

Each redirection and why it is needed: docs/cpu.md#what-is-redirected
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
import time
import types
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_megatron", "disable_cpu_megatron", "enable_cpu_megatron", "is_cpu_megatron_enabled"]

_lock = threading.RLock()
_tls = threading.local()  # .mode: the _CudaToCpuMode pushed on this thread
_saved: list[tuple[object, str, object]] = []  # (owner, attr, original) for restoring
_enabled = False


def _is_cuda_device(dev: object) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):  # a bare int in a device slot means cuda:<int>
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, torch.device) and dev.type == "cuda"


def _cpu_type(t: object) -> object:
    """'torch.cuda.FloatTensor' or torch.cuda.FloatTensor -> 'torch.FloatTensor'."""
    name = (
        t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', '')}"
    )
    return name.replace("torch.cuda.", "torch.", 1) if name.startswith("torch.cuda.") else t


# Positional parameter names of torch.autograd.backward (False) / Tensor.backward (True).
_BACKWARD_ARGS = {
    False: ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs"),
    True: ("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs"),
}


def _engine_backward(
    tensors,
    grad_tensors=None,
    retain_graph=None,
    create_graph=False,
    grad_variables=None,
    inputs=None,
):
    """``torch.autograd.backward`` minus its ``__torch_function__`` re-dispatch."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = grad_variables if grad_tensors is None else grad_tensors
    grads = (None,) * len(tensors) if grads is None else grads
    grads = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
    filled = []
    for t, g in zip(tensors, grads, strict=True):
        if g is None and t.requires_grad:
            if t.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(t)
        filled.append(g)
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    torch.autograd.Variable._execution_engine.run_backward(
        tensors,
        tuple(filled),
        create_graph if retain_graph is None else retain_graph,
        create_graph,
        tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placement requests to CPU; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            args = tuple("cpu" if i and _is_cuda_device(a) else a for i, a in enumerate(args))
        elif func is torch.Tensor.type:
            if len(args) == 1 and kwargs.get("dtype") is None:
                name = func(*args)
                cuda = name.startswith("torch.") and not name.startswith("torch.cuda.")
                return "torch.cuda." + name[len("torch.") :] if cuda else name
            args = tuple(_cpu_type(a) if i else a for i, a in enumerate(args))
            if kwargs.get("dtype") is not None:
                kwargs = {**kwargs, "dtype": _cpu_type(kwargs["dtype"])}
        elif func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        elif func is torch.Tensor.record_stream:
            return None
        elif func is torch.Tensor.backward or func is torch.autograd.backward:
            bound = dict(zip(_BACKWARD_ARGS[func is torch.Tensor.backward], args, strict=False))
            for k, v in kwargs.items():
                bound["grad_tensors" if k == "gradient" else k] = v
            with self:  # re-push: the engine snapshots the mode stack for the backward pass
                return _engine_backward(**bound)
        if kwargs:
            if _is_cuda_device(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


class _CpuStream:
    """``torch.cuda.Stream`` stand-in: CPU ops are synchronous, so every wait is a no-op."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device, self.priority = torch.device("cpu"), priority

    def wait_stream(self, stream): ...
    def wait_event(self, event): ...
    def synchronize(self): ...

    def query(self):
        return True

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record(self)
        return event


class _CpuEvent:
    """``torch.cuda.Event`` stand-in; ``elapsed_time`` is wall-clock milliseconds."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self._t = 0.0

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None): ...
    def synchronize(self): ...

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * (end._t - self._t)


_DEFAULT_STREAM = _CpuStream()


def _device_properties(device=None):
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        name="cpu", major=0, minor=0, total_memory=ram, multi_processor_count=os.cpu_count() or 1
    )


def _mem_get_info(device=None):
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return free, _device_properties().total_memory


def _noop(*args, **kwargs):
    return None


def _nullcontext(*args, **kwargs):
    return contextlib.nullcontext()


def _manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


_RNG_STANDINS = {
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "initial_seed": lambda: torch.initial_seed(),
}
_TORCH_CUDA_STANDINS = {
    "current_device": lambda: 0,
    "set_device": _noop,
    "device": _nullcontext,
    "synchronize": _noop,
    "Stream": _CpuStream,
    "Event": _CpuEvent,
    "current_stream": lambda device=None: _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "set_stream": _noop,
    "stream": _nullcontext,
    "get_device_properties": _device_properties,
    "get_device_capability": lambda device=None: (0, 0),
    "get_device_name": lambda device=None: "cpu",
    "mem_get_info": _mem_get_info,
    "reset_peak_memory_stats": _noop,  # (the CUDA allocator's statistics stay empty)
    **_RNG_STANDINS,
}


def _mcore_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _mcore_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


# (module, attribute, replacement); needed by megatron-core 0.16.1 (and Megatron-LM main).
_MEGATRON_PATCHES = [
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _mcore_get_cuda_rng_state),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _mcore_set_cuda_rng_state),
]


def _rng_filter(record: logging.LogRecord) -> bool:
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = "megatron.core.tensor_parallel.random"


def _patch(owner: object, attr: str, value: object) -> None:
    if isinstance(value, types.FunctionType):
        # One distinct object per patched name: torch._dynamo's trace rules index torch.*
        # callables by identity and assert if one object sits under two differently-ruled names.
        value = functools.wraps(value)(lambda *a, _f=value, **k: _f(*a, **k))
    _saved.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, value)


def enable_cpu_megatron(force: bool = False) -> None:
    """Redirect Megatron-Core's CUDA assumptions to CPU in this process (and thread).

    Idempotent. Raises ``RuntimeError`` if CUDA is available and ``force`` is False.
    """
    global _enabled
    with _lock:
        if not _enabled:
            if torch.cuda.is_available() and not force:
                raise RuntimeError(
                    "enable_cpu_megatron(): CUDA is available; the CPU mode would silently move "
                    "every CUDA tensor to CPU. Pass force=True to use it anyway."
                )
            for name, fn in _TORCH_CUDA_STANDINS.items():
                _patch(torch.cuda, name, fn)
            for name, fn in _RNG_STANDINS.items():
                _patch(torch.cuda.random, name, fn)
            _patch(torch.cuda.nvtx, "range_push", _noop)
            _patch(torch.cuda.nvtx, "range_pop", _noop)
            _patch(torch.cuda.nvtx, "range", _nullcontext)
            for module, attr, fn in _MEGATRON_PATCHES:
                mod = importlib.import_module(module)
                if hasattr(mod, attr):
                    _patch(mod, attr, fn)
            logging.getLogger(_RNG_LOGGER).addFilter(_rng_filter)
            _enabled = True
        if getattr(_tls, "mode", None) is None:
            _tls.mode = _CudaToCpuMode()
            _tls.mode.__enter__()


def disable_cpu_megatron() -> None:
    """Undo ``enable_cpu_megatron`` (call it on the thread that enabled the mode)."""
    global _enabled
    with _lock:
        if getattr(_tls, "mode", None) is not None:
            _tls.mode.__exit__(None, None, None)
            _tls.mode = None
        while _saved:
            owner, attr, original = _saved.pop()
            setattr(owner, attr, original)
        logging.getLogger(_RNG_LOGGER).removeFilter(_rng_filter)
        _enabled = False


def is_cpu_megatron_enabled() -> bool:
    """True once ``enable_cpu_megatron`` has run in this process (and not been undone)."""
    return _enabled


@contextlib.contextmanager
def cpu_megatron(force: bool = False) -> Iterator[None]:
    """Enable the CPU mode for a block -- e.g. the body of a worker process -- and undo it on
    exit if (and only if) this block was the one that enabled it."""
    was_enabled = _enabled
    enable_cpu_megatron(force=force)
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_megatron()
