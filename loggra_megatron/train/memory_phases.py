"""Peak memory of each phase of an RL step, the step's peak, and on CUDA the reserved and
free bytes (the ``memory/`` keys of ``metric_keys.py``).

Mechanism: the process has one high-water mark of the memory it uses, which can be lowered to
the current use and read later, so that a phase's peak is

    peak(phase) = max over t in the phase of used(t)

read at the phase's end after lowering the mark at its start. On CUDA the mark is the caching
allocator's peak allocated bytes (``torch.cuda.max_memory_allocated``; its peak reserved bytes
alongside), lowered by ``torch.cuda.reset_peak_memory_stats``. On CPU it is the kernel's peak
resident set size (``VmHWM`` in ``/proc/self/status``), lowered to the current RSS by writing
``5`` to ``/proc/self/clear_refs`` (Linux). Where that write is refused or the file is absent,
the mark cannot be lowered: every phase then reads ``ru_maxrss``, the process's peak since it
started (docs/metrics.md#memory).

Phases nest exclusively: entering one folds the mark so far into the enclosing phase and lowers
it, leaving one records the mark as its own peak and lowers it again, so every moment of a step
belongs to exactly one phase (the innermost open one) and the step's peak is the max over its
phases. A phase entered several times in a step (a mini-batch's predicted-KL control) reports
the max of its entries.

The mark is the process's (the allocator's per device, the kernel's per process), so one
recorder per process, ``PHASE_PEAKS``, owns it: the trainer starts and ends each RL step,
and the code of a phase encloses it in ``PHASE_PEAKS.phase(name)``.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

PHASES = ("rollout", "log_probs", "train", "kl_control")
"""The phases an RL step reports: generation and rewards; the reference log-prob forwards;
the forward/backward passes and optimizer steps of the actor's mini-batches; predicted-KL
control's optimizer step (its trials and probe)."""


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
        self.resettable = True
        """CPU: the kernel lowered the mark when asked (False: ``ru_maxrss`` instead)."""

    def start_step(self, device: torch.device) -> None:
        """Start recording an RL step on ``device``; forgets the previous step's peaks."""
        self.device = device
        self.allocated, self.reserved, self.open = {}, {}, []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak memory of what the block runs as phase ``name`` (see the module
        docstring); records nothing outside a step."""
        if name not in PHASES:
            raise ValueError(f"unknown memory phase {name!r}: one of {', '.join(PHASES)}")
        if self.device is None:
            yield
            return
        if self.open:
            self._record(self.open[-1])
        self._lower_mark()
        self.open.append(name)
        try:
            yield
        finally:
            self.open.pop()
            self._record(name)
            self._lower_mark()

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
        self.device = None
        return metrics

    def _record(self, name: str) -> None:
        """Fold the mark into phase ``name``'s peak."""
        if self.device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
            self.reserved[name] = max(self.reserved.get(name, 0), reserved)
        else:
            allocated = self._peak_rss()
        self.allocated[name] = max(self.allocated.get(name, 0), allocated)

    def _lower_mark(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self.resettable:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:  # not Linux, or not permitted: the process's peak from now on
                self.resettable = False

    def _peak_rss(self) -> int:
        """The kernel's high-water mark of this process's RSS, bytes (``ru_maxrss`` where
        it cannot be lowered)."""
        if self.resettable:
            try:
                with open("/proc/self/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            return int(line.split()[1]) * 1024  # kB
            except OSError:
                pass
            self.resettable = False
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


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
