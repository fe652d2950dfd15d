"""The tiny CPU example's first RL steps against their golden ``metrics.jsonl``
(``tools/golden_metrics.py``): a change meant to keep behaviour keeps every metric. A change
meant to change it rewrites the file with ``python tools/golden_metrics.py --update`` and
says why in its commit."""

import importlib.util
import os

import pytest
import warm_launch
from rl_runs import torchrun

pytestmark = pytest.mark.megatron  # skipped where no golden file is this CPU's and versions'

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "golden_metrics", os.path.join(ROOT, "tools", "golden_metrics.py")
)
golden_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(golden_metrics)


def test_the_tiny_example_logs_its_golden_metrics(tmp_path):
    made = golden_metrics.read_golden()
    why = golden_metrics.not_comparable(made)
    if why is not None:  # another kind of CPU, or other versions, compute other bits
        pytest.skip(why)
    _, golden = made
    prefix = str(tmp_path / "tokenizer")
    _, tool, *argv = golden_metrics.tokenizer_command(prefix)
    assert warm_launch.run(tool, argv).returncode == 0
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


def test_the_golden_file_is_named_by_the_cpu_kernels_and_one_exists():
    """Each golden file is one kind of CPU's (``cpu_kernels`` names this one's)."""
    kernels = golden_metrics.cpu_kernels()
    assert kernels.split("+")[0] == __import__("torch").backends.cpu.get_cpu_capability()
    assert golden_metrics.golden_path("AVX2").endswith("tiny_cpu_metrics.AVX2.jsonl")
    names = os.listdir(golden_metrics.GOLDEN_DIR)
    assert names and all(n.startswith("tiny_cpu_metrics.") for n in names), names
