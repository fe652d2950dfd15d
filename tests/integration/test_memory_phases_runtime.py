"""The measured memory of an RL step (``loggra_megatron/train/memory_phases.py``): a phase
reports its own peak, not the run's (the mark restarts when it starts), phases nest without
overlap, the step's peak is the max of its phases, the peaks reduce over ranks as their max
and free memory as its min, and a tiny ``pretrain_rl.py`` run logs every phase; the start-up
warning on an allocator/NCCL environment other than the memory estimator's."""

from __future__ import annotations

import os
import time

import pytest
import torch
from rl_runs import tiny_argv, torchrun

from loggra_megatron.memory.estimate_config import EstimateConfig
from loggra_megatron.memory.fit_report import launch_environment
from loggra_megatron.metrics import read_metrics
from loggra_megatron.train.memory_phases import PHASES, PhasePeaks
from loggra_megatron.train.preflight import ESTIMATED_ENVIRONMENT, environment_note

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

MiB = 2**20
CPU = torch.device("cpu")


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _touch(nbytes: int) -> None:
    """Allocate ``nbytes`` of pages the kernel must back (ones, not empty), hold them for
    many sampling intervals, then free them (sizes above glibc's largest mmap threshold,
    32 MiB: returned to the kernel at once)."""
    block = torch.ones(nbytes // 4, dtype=torch.float32)
    time.sleep(0.05)
    assert block.sum() > 0
    del block


@pytest.fixture
def recorder():
    peaks = PhasePeaks()
    peaks.start_step(CPU)
    return peaks


def test_a_phase_reports_its_own_peak_not_an_earlier_phases(recorder):
    base = _rss()
    with recorder.phase("rollout"):
        _touch(256 * MiB)
    with recorder.phase("train"):  # a smaller allocation after a larger one
        _touch(64 * MiB)
    if not recorder.sampled:
        pytest.skip("no /proc/self/statm: no phase peak to test")
    metrics = recorder.step_metrics()
    rollout, train = metrics["memory/peak_bytes/rollout"], metrics["memory/peak_bytes/train"]
    assert rollout - base == pytest.approx(256 * MiB, abs=24 * MiB)
    assert train - base == pytest.approx(64 * MiB, abs=24 * MiB)  # the run's peak: +256
    assert metrics["memory/peak_bytes"] == max(rollout, train) == rollout
    phases = {"memory/peak_bytes/rollout", "memory/peak_bytes/train"}
    assert set(metrics) == {"memory/peak_bytes", *phases}  # no reserved or free bytes on CPU
    assert recorder.device is None  # the step has ended


def test_nested_phases_do_not_overlap_and_a_repeated_one_keeps_its_max(recorder):
    base = _rss()
    with recorder.phase("train"):
        _touch(48 * MiB)
        with recorder.phase("kl_control"):
            _touch(192 * MiB)
        with recorder.phase("kl_control"):  # the next mini-batch's, smaller
            _touch(40 * MiB)
        _touch(96 * MiB)
    if not recorder.sampled:
        pytest.skip("no /proc/self/statm: no phase peak to test")
    metrics = recorder.step_metrics()
    train, control = metrics["memory/peak_bytes/train"], metrics["memory/peak_bytes/kl_control"]
    assert control - base == pytest.approx(192 * MiB, abs=24 * MiB)
    assert train - base == pytest.approx(96 * MiB, abs=24 * MiB)  # not the inner 192
    assert metrics["memory/peak_bytes"] == control


def test_phases_outside_a_step_record_nothing_and_names_are_checked():
    peaks = PhasePeaks()
    with peaks.phase("train"):
        _touch(40 * MiB)
    assert peaks.allocated == {} and peaks.step_metrics() == {}
    with pytest.raises(ValueError, match="unknown memory phase 'generation'"):
        peaks.phase("generation").__enter__()
    assert PHASES == ("rollout", "log_probs", "train", "kl_control")


# ---------------------------------------------------------------- over ranks
def _reduced(rank):
    from megatron.core import parallel_state as ps

    from loggra_megatron.train.reporting import reduce_metrics

    local = [
        {"memory/peak_bytes": 10.0, "memory/free_bytes": 5.0, "reward/mean": 0.25},
        {"memory/peak_bytes": 20.0, "memory/free_bytes": 3.0, "reward/mean": 0.75}
        | {"memory/peak_bytes/log_probs": 7.0},
    ][rank]
    pp, dp = ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()
    return reduce_metrics(local, pp, dp, CPU)


def test_peaks_reduce_to_the_max_of_the_ranks_and_free_memory_to_the_min():
    from loggra_megatron.testing import run_distributed

    for reduced in run_distributed(_reduced, 2):  # DP = 2
        assert reduced == {
            "memory/peak_bytes": 20.0,
            "memory/free_bytes": 3.0,
            "memory/peak_bytes/log_probs": 7.0,  # one rank has it
            "reward/mean": 0.5,
        }


# ---------------------------------------------------------------- a pretrain_rl.py run
def test_a_tiny_run_logs_the_peak_of_every_phase(tokenizer, tmp_path):
    out = tmp_path / "run"
    argv = tiny_argv(
        tokenizer, **{"output-dir": out, "bf16": True, "kl-target": 0.05, "kl-coef": 0.01}
    )
    torchrun(argv)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        phases = {p: row[f"memory/peak_bytes/{p}"] for p in PHASES}
        assert all(v > 0 for v in phases.values()), phases
        assert row["memory/peak_bytes"] == max(phases.values())
        assert "memory/reserved_bytes" not in row and "memory/free_bytes" not in row  # CPU


# ---------------------------------------------------------------- the start-up check
def test_the_environment_check_warns_for_another_environment_only():
    right = dict(ESTIMATED_ENVIRONMENT)
    assert environment_note(right, cuda=True) is None
    assert environment_note({}, cuda=False) is None  # CPU runs: nothing to say
    note = environment_note({}, cuda=True)
    assert note.startswith("warning: PYTORCH_CUDA_ALLOC_CONF unset and NCCL_NVLS_ENABLE unset")
    assert "expandable_segments:True NCCL_NVLS_ENABLE=0" in note
    other = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False",
        "NCCL_NVLS_ENABLE": "0",
    }
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True,expandable_segments:False'" in (
        environment_note(other, cuda=True)
    )
    spaced = {**right, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}
    assert environment_note(spaced, cuda=True) is None
    assert "NCCL_NVLS_ENABLE='1'" in environment_note({**right, "NCCL_NVLS_ENABLE": "1"}, True)
    # PyTorch reads PYTORCH_ALLOC_CONF first: PYTORCH_CUDA_ALLOC_CONF is then ignored
    newer = {**right, "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    assert "PYTORCH_ALLOC_CONF='max_split_size_mb:64'" in environment_note(newer, cuda=True)
    assert (
        environment_note({**newer, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True) is None
    )


def test_the_estimators_environment_is_the_one_the_check_accepts():
    launched = launch_environment(EstimateConfig(expandable_segments=True, nccl_nvls=False))
    assert launched == ESTIMATED_ENVIRONMENT
    default = launch_environment(EstimateConfig())
    assert default == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
        "NCCL_NVLS_ENABLE": "1",
    }
    assert environment_note(default, cuda=True) is not None


def test_the_fit_output_names_its_environment(capsys):
    from launch_flags import ROOT, estimator_cli

    cli = estimator_cli()
    qwen = os.path.join(ROOT, "tools", "configs", "qwen2.5-7b-instruct.json")
    argv = [
        *("--fit", "--fit-top", "1", "--hf-config", qwen),
        *("--gpu-memory-gb", "79.1", "--bf16", "--seq-length", "4096"),
        *("--max-new-tokens", "3072", "--prompts-per-step", "64", "--global-batch-size", "256"),
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    launch = "launch    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False NCCL_NVLS_ENABLE=1 "
    assert launch + "torchrun ... pretrain_rl.py\n" in text


def test_preflight_notes_the_environment_on_cuda(tokenizer, monkeypatch):
    from loggra_megatron.arguments import parse_args
    from loggra_megatron.train import preflight

    def notes(cuda: bool, env: dict[str, str]) -> list[str]:
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: cuda)
        return preflight.preflight(cfg).notes

    cfg = parse_args(tiny_argv(tokenizer))  # --device auto: CUDA where one is visible
    assert notes(True, {})[0].startswith("warning: PYTORCH_CUDA_ALLOC_CONF unset")
    assert not any("NCCL_NVLS_ENABLE" in n for n in notes(True, ESTIMATED_ENVIRONMENT))
    assert not any("NCCL_NVLS_ENABLE" in n for n in notes(False, {}))
