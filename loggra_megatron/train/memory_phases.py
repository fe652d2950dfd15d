"""Peak memory of each phase of an RL step, the step's peak, and on CUDA the reserved and
free bytes (the ``memory/`` keys of ``metric_keys.py``).

Mechanism: a phase's peak is

    peak(phase) = max over t in the phase of used(t)

from a high-water mark restarted from the current use when the phase starts and read when it
ends. On CUDA the mark is the caching allocator's peak allocated bytes
(``torch.cuda.max_memory_allocated``; its peak reserved bytes alongside), restarted by
``torch.cuda.reset_peak_memory_stats``. On CPU it is kept here, never by the kernel: while a
step is recorded a daemon thread reads the process's resident set size (``/proc/self/statm``,
Linux) every ``SAMPLE_INTERVAL_S`` (1 ms) and keeps the largest, and every phase boundary
reads it once more. The kernel's own mark (``VmHWM``, what ``getrusage``, ``/usr/bin/time``
and Slurm's MaxRSS report for the run) is left alone. Resolution: RSS held for less than an
interval can be missed, and so can RSS held while the sampler waits for the GIL (up to
``sys.getswitchinterval()``, 5 ms, while the step runs Python code; PyTorch's operators
release it), so a CPU phase peak is a lower bound of its true peak, exact for memory still
held at the phase's end. Where ``/proc/self/statm`` cannot be read (not Linux) every phase
reads ``ru_maxrss``, the process's peak since it started (docs/metrics.md#memory).

Phases nest exclusively: entering one folds the mark so far into the enclosing phase and
restarts it, leaving one records the mark as its own peak and restarts it again, so every
moment of a step belongs to exactly one phase (the innermost open one) and the step's peak is
the max over its phases. A phase entered several times in a step (a mini-batch's
predicted-KL control) reports the max of its entries.

The mark is the process's (the allocator's per device, the sampled RSS per process), so one
recorder per process, ``PHASE_PEAKS``, owns it: the trainer starts and ends each RL step,
and the code of a phase encloses it in ``PHASE_PEAKS.phase(name)``.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

STATM = "/proc/self/statm"
"""This process's memory in pages; its second field is the resident set size."""
SAMPLE_INTERVAL_S = 0.001
"""How often the CPU sampler reads the resident set size."""

PHASES = ("rollout", "log_probs", "train", "kl_control")
"""The phases an RL step reports: generation and rewards; the reference log-prob forwards;
the forward/backward passes and optimizer steps of the actor's mini-batches; predicted-KL
control's optimizer step (its trials and probe)."""


class RssSampler:
    """This process's resident set size, read every ``SAMPLE_INTERVAL_S`` on a daemon
    thread between ``start()`` and ``stop()``; ``take()`` gives the largest since the last
    ``take()`` (the RSS now included) and restarts from the RSS now."""

    def __init__(self):
        self._lock = threading.Lock()
        self._peak = 0
        self._fd: int | None = None
        self._page = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (if not running); OSError where ``STATM`` cannot be read."""
        if self._thread is not None:
            return
        self._fd = os.open(STATM, os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._peak = self._rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        os.close(self._fd)

    def take(self) -> int:
        now = self._rss()
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        return peak

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            rss = self._rss()
            with self._lock:
                self._peak = max(self._peak, rss)

    def _rss(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page


class PhasePeaks:
    """Records the peak memory of each phase of one RL step at a time (module docstring)."""

    def __init__(self):
        self.device: torch.device | None = None
        """The device of the step being recorded; None between steps (phases then record
        nothing)."""
        self.allocated: dict[str, int] = {}
        """Peak bytes of each phase of the step (CUDA: allocated; CPU: resident)."""
        self.reserved: dict[str, int] = {}
        """CUDA: the allocator's peak reserved bytes of each phase."""
        self.open: list[str] = []
        """The phases entered and not yet left, innermost last."""
        self.sampler = RssSampler()
        """CPU: the resident set size's mark."""
        self.sampled = True
        """CPU: the sampler runs (False: ``STATM`` unreadable, ``ru_maxrss`` instead)."""

    def start_step(self, device: torch.device) -> None:
        """Start recording an RL step on ``device``; forgets the previous step's peaks."""
        self.device = device
        self.allocated, self.reserved, self.open = {}, {}, []
        if device.type != "cuda" and self.sampled:
            try:
                self.sampler.start()
            except OSError:  # not Linux: the process's peak from now on
                self.sampled = False

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak memory of what the block runs as phase ``name`` (see the module
        docstring); records nothing outside a step."""
        if name not in PHASES:
            raise ValueError(f"unknown memory phase {name!r}: one of {', '.join(PHASES)}")
        if self.device is None:
            yield
            return
        mark = self._take_mark()
        if self.open:
            self._record(self.open[-1], *mark)
        self.open.append(name)
        try:
            yield
        finally:
            self.open.pop()
            self._record(name, *self._take_mark())

    def step_metrics(self) -> dict[str, float]:
        """End the step: the peak of each phase it ran and their max, and on CUDA the peak
        reserved bytes of its phases and the free device memory now (``metric_keys.py``)."""
        metrics = {f"memory/peak_bytes/{name}": float(b) for name, b in self.allocated.items()}
        if self.allocated:
            metrics["memory/peak_bytes"] = float(max(self.allocated.values()))
        if self.device is not None and self.device.type == "cuda":
            if self.reserved:
                metrics["memory/reserved_bytes"] = float(max(self.reserved.values()))
            metrics["memory/free_bytes"] = float(torch.cuda.mem_get_info(self.device)[0])
        self.sampler.stop()
        self.device = None
        return metrics

    def _take_mark(self) -> tuple[int, int | None]:
        """``(peak bytes, CUDA: peak reserved bytes)`` since the mark was last taken, and
        restart the mark from the current use."""
        if self.device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            return allocated, reserved
        if self.sampled:
            return self.sampler.take(), None
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None  # KiB on Linux

    def _record(self, name: str, allocated: int, reserved: int | None) -> None:
        """Fold a mark into phase ``name``'s peak."""
        self.allocated[name] = max(self.allocated.get(name, 0), allocated)
        if reserved is not None:
            self.reserved[name] = max(self.reserved.get(name, 0), reserved)


PHASE_PEAKS = PhasePeaks()
"""This process's recorder (its memory's high-water mark is one per process)."""


def usable_device_bytes(device: torch.device) -> int:
    """What a process can allocate on its CUDA ``device``: the free memory plus what
    PyTorch's allocator already holds, the least over the ranks of the default group (one
    KV budget for ranks that must generate alike). Collective."""
    free, _ = torch.cuda.mem_get_info(device)
    usable = torch.tensor(free + torch.cuda.memory_reserved(device), device=device)
    dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    return int(usable)


def size_kv_budget_here(size_fn, model_args, plan, device: torch.device):
    """On CUDA with ``plan``'s ``--inference-max-tokens`` unset and a sizing function (the
    run's ``KVBudgetFn``): ``size_fn(model_args, plan, the least usable bytes over the
    default group, os.environ)``, ``(tokens or None, the note to print)``; collective. None
    elsewhere (nothing to size)."""
    if device.type != "cuda" or plan.inference_max_tokens is not None or size_fn is None:
        return None
    return size_fn(model_args, plan, usable_device_bytes(device), os.environ)
