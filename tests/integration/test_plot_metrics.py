"""tools/plot_metrics.py turns metrics.jsonl files into PNG figures."""

import os
import subprocess
import sys
from pathlib import Path

from loggra_megatron.metrics import MetricsLogger

ROOT = str(Path(__file__).resolve().parents[2])
TOOL = os.path.join(ROOT, "tools", "plot_metrics.py")


def _run(path, reward_slope, with_kl):
    with MetricsLogger(str(path)) as log:
        for step in range(1, 6):
            metrics = {
                "reward/mean": 0.1 + reward_slope * step,
                "time/step_s": 1.0,
                "throughput/tokens_per_s": 1000.0,
                "memory/optimizer_state_bytes": 2**30,
            }
            if with_kl:  # the LoGRA run
                for family in ("qkv", "proj", "fc1", "fc2"):
                    metrics[f"loggra/captured_energy/{family}/mean"] = 0.9 - 0.01 * step
                    metrics[f"loggra/captured_energy/{family}/min"] = 0.7 - 0.01 * step
            if with_kl:
                metrics.update(
                    {
                        "kl/ref": 0.01 * step,
                        "kl/predicted_committed": 0.02,
                        "kl/realized": 0.021,
                        "kl/step_scale": 0.8,
                    }
                )
            log.log(step, metrics)


def test_plots_every_logged_topic_for_several_runs(tmp_path):
    _run(tmp_path / "dense", 0.01, with_kl=False)
    _run(tmp_path / "loggra", 0.02, with_kl=True)
    out = tmp_path / "plots"
    proc = subprocess.run(
        [
            sys.executable,
            TOOL,
            f"dense={tmp_path / 'dense'}",
            str(tmp_path / "loggra" / "metrics.jsonl"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    written = sorted(os.path.basename(p) for p in proc.stdout.split())
    assert written == [
        "captured_energy.png",
        "kl.png",
        "memory.png",
        "reward.png",
        "step_scale.png",
        "throughput.png",
    ]
    for name in written:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_missing_run_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, TOOL, str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "no such run" in proc.stderr
