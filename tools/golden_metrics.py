"""The tiny CPU example's first RL steps as a golden ``metrics.jsonl``: the check that a
change meant to keep behaviour (a refactor, a move) keeps it.

    python tools/golden_metrics.py            # a fresh run against the golden file
    python tools/golden_metrics.py --update   # rewrite it (after a change meant to change it)

The run is ``examples/tiny_cpu/run.sh``'s, shortened: the same tokenizer recipe, model,
GRPO and LoGRA settings (the backward sketch, bf16, predicted-KL control, a reference), 20
warm-up steps and 3 RL steps on 2 processes. Every metric but the timings and memory peaks
(``VOLATILE``) is compared, to ``--rtol`` (default 1e-6: bf16 runs on a shared CPU differ in
the last bit now and then).

CPUs of other vector extensions round bf16 matmuls differently, and an RL step samples from
what it computed, so a golden file holds the run of one kind of CPU: its name carries the
CPU's kernels (``cpu_kernels``: torch's CPU capability, and the bf16 extensions oneDNN
uses), ``tests/golden/tiny_cpu_metrics.<kernels>.jsonl``. It records the torch and
megatron-core versions it was made with; on another kind of CPU, or with other versions,
the check says so and compares nothing (``tests/integration/test_golden_metrics.py`` skips
there), until ``--update`` makes that CPU's file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
BF16_EXTENSIONS = ("avx512_bf16", "amx_bf16")
"""CPU flags that change oneDNN's bf16 matmuls beyond torch's CPU capability."""
VOLATILE = ("time/", "throughput/", "memory/", "sync/seconds")
TOKENIZER = ["--builtin-tasks", "20000", "--seed", "0", "--vocab-size", "256"]
FLAGS = [
    *("--task", "arithmetic", "--num-tasks", "20000", "--task-digits", "1"),
    *("--task-operators", "+-", "--num-layers", "4", "--hidden-size", "128"),
    *("--num-attention-heads", "4", "--seq-length", "64", "--bf16"),
    *("--sft-iters", "20", "--sft-lr", "1e-3", "--train-iters", "3"),
    *("--prompts-per-step", "16", "--num-generations", "8", "--max-new-tokens", "16"),
    *("--global-batch-size", "64", "--micro-batch-size", "32", "--lr", "1e-4"),
    *("--lr-warmup-iters", "5", "--optimizer", "loggra", "--loggra-rank", "16"),
    *("--kl-target", "0.02", "--kl-coef", "0.01", "--kl-ref-estimator", "k3"),
]
"""``examples/tiny_cpu/run.sh``'s flags with 20 warm-up steps and 3 RL steps."""


def versions() -> dict[str, str]:
    import megatron.core
    import torch

    return {"torch": torch.__version__, "megatron_core": megatron.core.__version__}


def cpu_kernels() -> str:
    """torch's CPU capability (``AVX2``, ``AVX512``...), with the ``BF16_EXTENSIONS`` the
    CPU has (Linux: ``/proc/cpuinfo``): ``AVX512+avx512_bf16+amx_bf16``."""
    import torch

    flags: set[str] = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
    extensions = [e for e in BF16_EXTENSIONS if e in flags]
    return "+".join([torch.backends.cpu.get_cpu_capability(), *extensions])


def golden_path(kernels: str | None = None) -> str:
    """The golden file of CPUs with ``kernels`` (default: this one's)."""
    return os.path.join(GOLDEN_DIR, f"tiny_cpu_metrics.{kernels or cpu_kernels()}.jsonl")


def tokenizer_command(prefix: str) -> list[str]:
    """The command that trains the example's tokenizer to ``prefix``.model."""
    tool = os.path.join(ROOT, "tools", "train_tokenizer.py")
    return [sys.executable, tool, *TOKENIZER, "--output-prefix", prefix]


def pretrain_argv(prefix: str, out: str) -> list[str]:
    """``pretrain_rl.py``'s flags of the shortened example (tokenizer ``prefix``.model)."""
    return ["--tokenizer-model", f"{prefix}.model", *FLAGS, "--output-dir", out]


def read_run(out: str) -> list[dict]:
    """The run's metrics in ``out``, one dict per RL step, less the ``VOLATILE`` keys."""
    from loggra_megatron.metrics import read_metrics

    return [
        {k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in read_metrics(out)
    ]


def run(out: str) -> list[dict]:
    """The shortened example in ``out`` on 2 processes; its metrics (``read_run``)."""
    prefix = os.path.join(out, "tokenizer")
    subprocess.run(tokenizer_command(prefix), check=True)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launch += ["--standalone", os.path.join(ROOT, "pretrain_rl.py"), *pretrain_argv(prefix, out)]
    subprocess.run(launch, check=True, cwd=ROOT)
    return read_run(out)


def differences(golden: list[dict], fresh: list[dict], rtol: float) -> list[str]:
    """Every step, key and value where ``fresh`` is not ``golden`` (numbers: to ``rtol``)."""
    if len(golden) != len(fresh):
        return [f"{len(fresh)} steps logged, the golden file has {len(golden)}"]
    out = []
    for want, got in zip(golden, fresh, strict=True):
        step = want.get("step")
        for key in sorted(want.keys() | got.keys()):
            a, b = want.get(key), got.get(key)
            same = a == b or (
                isinstance(a, float | int)
                and isinstance(b, float | int)
                and math.isclose(a, b, rel_tol=rtol, abs_tol=rtol)
            )
            if not same:
                out.append(f"step {step}: {key} is {b!r}, golden {a!r}")
    return out


def read_golden() -> tuple[dict[str, str], list[dict]] | None:
    """``(the versions it was made with, its rows)`` of this CPU's golden file, or None when
    there is none."""
    if not os.path.exists(golden_path()):
        return None
    with open(golden_path(), encoding="utf-8") as f:
        header, *rows = (json.loads(line) for line in f if line.strip())
    return header["versions"], rows


def not_comparable(golden: tuple[dict[str, str], list[dict]] | None) -> str | None:
    """Why this machine's run is not compared with ``golden`` (``read_golden()``; None: it
    is)."""
    if golden is None:
        return (
            f"no golden metrics for CPUs with {cpu_kernels()} kernels "
            f"({os.listdir(GOLDEN_DIR)} exist): make them with tools/golden_metrics.py --update"
        )
    if golden[0] != versions():
        return f"the golden file was made with {golden[0]}, this is {versions()}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--update", action="store_true", help="rewrite the golden file")
    p.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance of a number")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        fresh = run(out)
    if args.update:
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(golden_path(), "w", encoding="utf-8") as f:
            for row in [{"versions": versions()}, *fresh]:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        print(f"wrote {golden_path()}: {len(fresh)} steps, {versions()}")
        return 0
    golden = read_golden()
    why = not_comparable(golden)
    if why is not None:
        print(f"{why}: not compared")
        return 0
    problems = differences(golden[1], fresh, args.rtol)
    print("\n".join(problems) or f"{len(fresh)} steps equal the golden file")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
