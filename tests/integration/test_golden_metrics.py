"""The tiny CPU example's first RL steps against their golden ``metrics.jsonl``
(``tools/golden_metrics.py``): a change meant to keep behaviour keeps every metric. A change
meant to change it rewrites the file with ``python tools/golden_metrics.py --update`` and
says why in its commit."""

import importlib.util
import os
import subprocess

import pytest
from rl_runs import torchrun

pytestmark = pytest.mark.megatron  # skipped where the golden file's versions differ

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "golden_metrics", os.path.join(ROOT, "tools", "golden_metrics.py")
)
golden_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(golden_metrics)


def test_the_tiny_example_logs_its_golden_metrics(tmp_path):
    made_with, golden = golden_metrics.read_golden()
    if made_with != golden_metrics.versions():
        pytest.skip(f"golden metrics made with {made_with}: other versions compute other bits")
    prefix = str(tmp_path / "tokenizer")
    subprocess.run(golden_metrics.tokenizer_command(prefix), check=True, capture_output=True)
    torchrun(golden_metrics.pretrain_argv(prefix, str(tmp_path)), nproc=2)
    fresh = golden_metrics.read_run(str(tmp_path))
    assert golden_metrics.differences(golden, fresh, rtol=1e-6) == []


def test_a_changed_metric_is_named():
    rows = [{"step": 1, "reward/mean": 0.5, "kl/ref": 0.0}]
    changed = [{"step": 1, "reward/mean": 0.5 + 1e-4, "kl/ref": 0.0, "new/key": 1.0}]
    assert golden_metrics.differences(rows, changed, rtol=1e-6) == [
        "step 1: new/key is 1.0, golden None",
        "step 1: reward/mean is 0.5001, golden 0.5",
    ]
    assert golden_metrics.differences(rows, rows[:0], rtol=1e-6) == [
        "0 steps logged, the golden file has 1"
    ]
