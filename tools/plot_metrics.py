"""Plot one or more runs' ``metrics.jsonl`` as PNG files, one figure per topic.

    python tools/plot_metrics.py runs/dense runs/loggra --out plots/
    python tools/plot_metrics.py dense=runs/parity/dense/seed1 loggra=runs/parity/LoGRA/seed1

Each positional argument is a run directory or ``metrics.jsonl`` file, optionally
``label=path``. Writes ``reward.png`` (reward and accuracy), ``kl.png`` (KL to the
reference; predicted vs realized KL of each committed step), ``step_scale.png``,
``memory.png``, ``throughput.png`` and ``captured_energy.png`` (the share of each weight
family's gradient energy LoGRA's sketch keeps: mean over layers solid, min dashed) with one
line per run; topics no run logged are skipped.
"""

from __future__ import annotations

import argparse
import os
import sys

PANELS = {
    "reward": [("reward/mean", "reward"), ("reward/accuracy", "accuracy")],
    "kl": [
        ("kl/ref", "KL to reference"),
        ("kl/predicted_committed", "predicted KL of the step"),
        ("kl/realized", "realized KL (held out)"),
    ],
    "step_scale": [("kl/step_scale", "step scale η")],
    "memory": [
        ("memory/optimizer_state_bytes", "optimizer state (GiB)"),
        ("memory/peak_bytes", "peak memory (GiB)"),
    ],
    "throughput": [("throughput/tokens_per_s", "tokens / s")],
    "captured_energy": [
        (f"loggra/captured_energy/{family}/mean", f"captured energy {family} (min dashed)")
        for family in ("qkv", "proj", "fc1", "fc2")
    ],
}
DASHED = {"/mean": "/min"}
"""Panels of a ``.../mean`` key also draw the run's ``.../min`` key, dashed."""


def parse_runs(specs: list[str]) -> list[tuple[str, str]]:
    runs = []
    for spec in specs:
        label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        if not os.path.exists(path):
            raise SystemExit(f"plot_metrics.py: error: no such run {path!r}")
        runs.append((label or os.path.basename(os.path.normpath(path)), path))
    return runs


def plot(runs: list[tuple[str, str]], out_dir: str) -> list[str]:
    """Write the figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loggra_megatron.metrics import read_metrics

    data = [(label, read_metrics(path)) for label, path in runs]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for topic, keys in PANELS.items():
        keys = [(k, title) for k, title in keys if any(k in r for _, rows in data for r in rows)]
        if not keys:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
        for ax, (key, title) in zip(axes[0], keys, strict=True):
            for i, (label, rows) in enumerate(data):
                _draw(ax, rows, key, label, f"C{i}", "-")
                for end, other in DASHED.items():
                    if key.startswith("loggra/") and key.endswith(end):
                        _draw(ax, rows, key[: -len(end)] + other, None, f"C{i}", "--")
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{topic}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _draw(ax, rows, key, label, color, style) -> None:
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if points:
        steps, values = zip(*points, strict=True)
        scale = 2**30 if key.startswith("memory/") else 1
        ax.plot(steps, [v / scale for v in values], style, color=color, label=label)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files ([label=]path)")
    ap.add_argument("--out", default="plots", help="output directory for the PNG files")
    args = ap.parse_args(argv)
    try:
        paths = plot(parse_runs(args.runs), args.out)
    except (OSError, ValueError) as e:  # a missing run, a metrics.jsonl that is not JSON
        ap.error(f"{' '.join(str(e).split())}")
    for path in paths:
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
