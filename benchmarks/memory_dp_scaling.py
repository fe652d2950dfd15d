"""Per-GPU memory of the 27B example by data-parallel size: dense Adam, LoGRA's gradient
sketch and LoGRA's backward sketch (``--loggra-sketch backward``), side by side.

    python benchmarks/memory_dp_scaling.py              # DP = 1, 2, 4, 8 (8, 16, 32, 64 GPUs)
    python benchmarks/memory_dp_scaling.py --json

The numbers are the memory estimator's (``tools/estimate_memory.py``, docs/memory.md): a
model, not a measurement. The run is the ``pretrain_rl.py`` command of
``examples/h100_8gpu/train_27b_loggra.sh`` (its flags read from the script, its exported
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` / ``NCCL_NVLS_ENABLE=0`` as the
estimator's ``--expandable-segments`` / ``--no-nccl-nvls``) on
``tools/configs/llama-style-27b.json``, at the script's TP = 8 with ``--grad-reduce-in-bf16``
added, on ``8·DP`` GPUs for each ``--dp``. Dense Adam is the estimator's dense column of the
same step (Megatron's default: fp32 masters and moments). Each LoGRA arm sets its own mode
over the script's: the gradient rows ``--loggra-sketch gradient``, the backward rows
``--loggra-sketch backward`` without the flags that apply to the gradient sketch only. Then
the script's own command (DP = 1, fp32 grads) in both modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from loggra_megatron.memory.model import GiB, estimate_rl_step_memory  # noqa: E402
from loggra_megatron.memory.run_step import modelled_step  # noqa: E402
from loggra_megatron.optim.config import LoGRAConfig  # noqa: E402

SCRIPT = os.path.join("examples", "h100_8gpu", "train_27b_loggra.sh")
CONFIG = os.path.join("tools", "configs", "llama-style-27b.json")
GPUS_PER_NODE = 8
MODES = (("dense Adam", "adam"), ("gradient", "gradient"), ("backward", "backward"))


def estimator():
    """``tools/estimate_memory.py`` as a module."""
    path = os.path.join(ROOT, "tools", "estimate_memory.py")
    spec = importlib.util.spec_from_file_location("estimate_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_flags(path: str) -> list[str]:
    """The estimator flags of a launch script: its ``pretrain_rl.py`` arguments (shell
    variables left as they are: the estimator reads no file but ``--hf-config``) and its
    exported allocator / NCCL settings."""
    with open(path) as f:
        text = f.read()
    start = re.search(r"^torchrun .*pretrain_rl\.py", text, re.M)
    if start is None:
        raise SystemExit(f"{path}: no 'torchrun ... pretrain_rl.py' command")
    lines = text[start.start() :].splitlines()
    end = next(i for i, line in enumerate(lines) if not line.rstrip().endswith("\\"))
    words = shlex.split(" ".join(line.rstrip().rstrip("\\") for line in lines[: end + 1]))
    at = next(i for i, w in enumerate(words) if w.endswith("pretrain_rl.py"))
    flags = [w for w in words[at + 1 :] if w != "$@"]  # the launcher's extra arguments
    if re.search(r"^export PYTORCH_CUDA_ALLOC_CONF=.*expandable_segments:True", text, re.M):
        flags.append("--expandable-segments")
    if re.search(r"^export NCCL_NVLS_ENABLE=(0|\$\{NCCL_NVLS_ENABLE:-0\})", text, re.M):
        flags.append("--no-nccl-nvls")
    return flags


def gradient_only_flags() -> set[str]:
    """Flags of LoGRA settings that apply to ``--loggra-sketch gradient`` only (declared so
    by the settings section itself)."""
    out = set()
    for f in dataclasses.fields(LoGRAConfig):
        rule = f.metadata.get("applies")
        if rule is not None and "--loggra-sketch gradient" in rule.when:
            out.add("--" + f.name.replace("_", "-"))
    return out


def without(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` less ``flags`` and their values."""
    out, skip = [], False
    for word in argv:
        if word.startswith("--"):
            skip = word in flags
        if not skip:
            out.append(word)
    return out


def estimates(cli, argv: list[str]) -> dict:
    """``{"adam", "loggra"}``: the estimator's dense column and LoGRA's (the command line's
    ``--loggra-sketch``), as ``tools/estimate_memory.py argv`` prints them."""
    cfg, est, _ = cli.settings(cli.build_parser(), argv)
    model, plan = modelled_step(cfg, est)
    dense = dataclasses.replace(plan, optimizer="adam")
    return {
        "adam": estimate_rl_step_memory(model, dense, est),
        "loggra": estimate_rl_step_memory(model, plan, est),
        "gpu_bytes": int(est.gpu_memory_gb * GiB),
    }


def saved(dense, other) -> float:
    return 100.0 * (dense.total_bytes - other.total_bytes) / dense.total_bytes


def run(args) -> dict:
    cli = estimator()
    flags = script_flags(os.path.join(ROOT, args.script))
    base = ["--hf-config", args.hf_config, "--gpu-memory-gb", str(args.gpu_memory_gb), *flags]
    base = without(base, {"--loggra-sketch"})  # the script's own mode: each arm sets its own
    backward = [*without(base, gradient_only_flags()), "--loggra-sketch", "backward"]
    base = [*base, "--loggra-sketch", "gradient"]
    rows = []
    for dp in args.dp:
        layout = ["--world-size", str(dp * GPUS_PER_NODE), "--grad-reduce-in-bf16"]
        grad = estimates(cli, [*base, *layout])
        bwd = estimates(cli, [*backward, *layout])
        rows.append(
            {
                "dp": dp,
                "gpus": dp * GPUS_PER_NODE,
                "adam": grad["adam"],
                "gradient": grad["loggra"],
                "backward": bwd["loggra"],
                "gpu_bytes": grad["gpu_bytes"],
            }
        )
    world = ["--world-size", str(GPUS_PER_NODE)]
    own, grad = estimates(cli, [*backward, *world]), estimates(cli, [*base, *world])
    example = {
        "adam": grad["adam"],
        "gradient": grad["loggra"],
        "backward": own["loggra"],
        "gpu_bytes": own["gpu_bytes"],
    }
    return {"rows": rows, "example": example, "args": args}


def _cell(b, gpu_bytes: int) -> str:
    return f"{b.total_bytes / GiB:.2f} {'✓' if b.fits(gpu_bytes) else '✗'}"


def report(result: dict) -> str:
    args, rows, ex = result["args"], result["rows"], result["example"]
    lines = [
        f"27B example ({args.hf_config}, {args.script}): TP 8, --grad-reduce-in-bf16, "
        f"GiB per GPU ({args.gpu_memory_gb:g} GiB usable; ✓ fits, ✗ does not)",
        "",
        f"{'DP':>3}{'GPUs':>6}{'dense Adam':>13}{'LoGRA gradient':>16}{'saved':>8}"
        f"{'LoGRA backward':>16}{'saved':>8}",
    ]
    for r in rows:
        g = r["gpu_bytes"]
        lines.append(
            f"{r['dp']:>3}{r['gpus']:>6}{_cell(r['adam'], g):>13}{_cell(r['gradient'], g):>16}"
            f"{saved(r['adam'], r['gradient']):>7.1f}%{_cell(r['backward'], g):>16}"
            f"{saved(r['adam'], r['backward']):>7.1f}%"
        )
    lines += [
        "",
        "static terms (GiB per GPU; the other static terms are the same for all three), peak:",
        f"{'DP':>3}  {'':<11}{'grads':>7}{'masters':>9}{'state':>8}{'S':>7}{'static':>8}  peak",
    ]
    widths = (7, 9, 8, 7, 8)
    for r in rows:
        for name, key in MODES:
            b = r[key]
            terms = (b.grads, b.master_params, b.optimizer_state, b.sketch_buffer, b.static_bytes)
            cells = "".join(f"{t / GiB:>{w}.2f}" for t, w in zip(terms, widths, strict=True))
            lines.append(f"{r['dp']:>3}  {name:<11}{cells}  {b.peak_phase}")
    g = ex["gpu_bytes"]
    adam, grad, own = ex["adam"], ex["gradient"], ex["backward"]
    lines += [
        "",
        "the example's own command (TP 8, DP 1, fp32 grads):",
        f"  dense Adam {_cell(adam, g)}; LoGRA gradient {_cell(grad, g)}, "
        f"{saved(adam, grad):.1f}% saved; LoGRA backward {_cell(own, g)}, "
        f"{saved(adam, own):.1f}% saved (static {own.static_bytes / GiB:.2f}, peak {own.peak_phase})",
    ]
    return "\n".join(lines)


def as_json(result: dict) -> dict:
    def gib(b) -> dict:
        return {"total": b.total_bytes / GiB, "static": b.static_bytes / GiB}

    rows = [
        {
            "dp": r["dp"],
            "gpus": r["gpus"],
            **{k: gib(r[k]) for k in ("adam", "gradient", "backward")},
            "saved_gradient_percent": saved(r["adam"], r["gradient"]),
            "saved_backward_percent": saved(r["adam"], r["backward"]),
        }
        for r in result["rows"]
    ]
    ex = result["example"]
    example = {
        **{k: gib(ex[k]) for k in ("adam", "gradient", "backward")},
        "saved_gradient_percent": saved(ex["adam"], ex["gradient"]),
        "saved_backward_percent": saved(ex["adam"], ex["backward"]),
    }
    return {"unit": "GiB", "rows": rows, "example": example}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="memory_dp_scaling.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--dp",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="data-parallel sizes (GPUs: 8 x DP; default: 1 2 4 8)",
    )
    ap.add_argument(
        "--script", default=SCRIPT, help=f"launch script, relative to the repository ({SCRIPT})"
    )
    ap.add_argument(
        "--hf-config", default=CONFIG, help=f"architecture, relative to the repository ({CONFIG})"
    )
    ap.add_argument(
        "--gpu-memory-gb", type=float, default=79.1, help="usable GiB per GPU (79.1: an H100)"
    )
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON (GiB)")
    args = ap.parse_args(argv)
    if any(d < 1 for d in args.dp):
        ap.error("--dp: sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)  # the script and the config are named relative to the repository
    result = run(args)
    print(json.dumps(as_json(result), indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
