"""CPU phase peaks (``loggra_megatron/train/memory_phases.py``) are sampled without touching
the kernel's high-water mark of the process, which the OS reports for the whole run."""

from __future__ import annotations

import time

import torch

from loggra_megatron.train import memory_phases
from loggra_megatron.train.memory_phases import PhasePeaks

MiB = 2**20
CPU = torch.device("cpu")


def _status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status``, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _hold(nbytes: int, seconds: float) -> None:
    """Hold ``nbytes`` of pages the kernel must back (ones, not empty) for ``seconds``, then
    free them (above glibc's largest mmap threshold, 32 MiB: returned to the kernel at once)."""
    block = torch.ones(nbytes // 4, dtype=torch.float32)
    time.sleep(seconds)
    assert block.sum() > 0
    del block


def test_phases_leave_the_process_peak_alone_and_see_what_they_allocate():
    peaks = PhasePeaks()
    base = _status("VmRSS")
    peaks.start_step(CPU)
    with peaks.phase("rollout"):
        _hold(192 * MiB, seconds=0.5)  # freed before the phase ends
    with peaks.phase("train"):
        pass
    metrics = peaks.step_metrics()
    rollout, train = metrics["memory/peak_bytes/rollout"], metrics["memory/peak_bytes/train"]
    assert rollout - base > 176 * MiB, (rollout, base)
    assert train < rollout - 128 * MiB  # the train phase's own peak, not the rollout's
    # never lowered (the kernel's RSS counters are batched per thread: a few pages of slack)
    assert _status("VmHWM") + 4 * MiB >= metrics["memory/peak_bytes"] == rollout


def test_the_sampler_runs_during_a_step_only():
    peaks = PhasePeaks()
    peaks.start_step(CPU)
    assert peaks.sampled and peaks.sampler._thread.is_alive()
    thread = peaks.sampler._thread
    peaks.step_metrics()
    assert not thread.is_alive() and peaks.sampler._thread is None


def test_without_statm_every_phase_reads_the_process_peak(monkeypatch):
    import resource

    monkeypatch.setattr(memory_phases, "STATM", "/nonexistent/statm")
    peaks = PhasePeaks()
    peaks.start_step(CPU)
    with peaks.phase("rollout"):
        pass
    assert not peaks.sampled
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peaks.step_metrics()["memory/peak_bytes/rollout"] == process_peak
