"""Training metrics: JSONL file, W&B, TensorBoard and one progress line per step (rank 0).

``MetricsLogger(output_dir, rank=...)`` is built on every rank; only rank 0 writes, the
others get a no-op logger (no file, no W&B run, no output). Each ``log(step, metrics)``
appends one JSON object to ``output_dir/metrics.jsonl`` (``step`` first, then the keys
sorted; a non-finite value as ``null``; fsync-ed per line), gives the values as they are to
W&B and TensorBoard, and prints one Megatron-like progress line. ``resolve_wandb_mode``
picks the W&B mode without probing the network; ``truncate_after(k)`` at a resume makes the
file of a resumed run equal that of an uninterrupted one. Keys, their meaning and how they
are reduced over ranks and updates: ``metric_keys``.

The file format, the progress line, the W&B mode rules and resume: docs/metrics.md
"""

from __future__ import annotations

import collections
import datetime
import importlib.util
import json
import logging
import math
import netrc
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from loggra_megatron.config import applies

logger = logging.getLogger(__name__)


@dataclass
class LoggingConfig:
    """Where the metrics go."""

    output_dir: str | None = None
    """Where metrics.jsonl goes (default: --save, else ./outputs/rl)."""
    wandb_project: str | None = None
    """Weights & Biases project (offline when there is no API key)."""
    wandb_run_name: str | None = applies(
        None, "with --wandb-project", lambda s: s["wandb_project"] is not None
    )
    """Weights & Biases run name."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory."""

    def metrics_dir(self, save: str | None) -> str:
        """Where ``metrics.jsonl`` goes: --output-dir, else ``save`` (--save), else
        ./outputs/rl."""
        return self.output_dir or save or os.path.join("outputs", "rl")


METRICS_FILE = "metrics.jsonl"
ETA_WINDOW = 20

# (metric key, progress-line label), in the order of the progress line.
_PROGRESS = (
    ("reward/mean", "reward"),
    ("kl/ref", "kl/ref"),
    ("kl/predicted", "kl/pred"),
    ("kl/step_scale", "η"),
    ("loss/total", "loss"),
)


def _has_api_key(env: Mapping[str, str]) -> bool:
    """Whether W&B credentials exist (env key or netrc entry); never touches the network."""
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        auth = netrc.netrc(path).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(
    project: str | None,
    mode: str | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """W&B mode by the rule of the module docstring (``env`` defaults to ``os.environ``)."""
    env = os.environ if env is None else env
    if project is None:
        return "disabled"
    if mode:
        return mode
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    return "online" if _has_api_key(env) else "offline"


def _number(key: str, value: Any) -> int | float | None:
    """A Python number from an int/float/bool, numpy scalar or one-element tensor."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``metrics.jsonl`` (or of a directory holding one); ``null`` stays None.

    A final line cut short by a crash is ignored; any other malformed line raises.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records


class MetricsLogger:
    """Per-step metrics to JSONL, W&B, TensorBoard and stdout on rank 0; no-op elsewhere."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        rank: int = 0,
        total_steps: int | None = None,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        wandb_mode: str | None = None,
        tensorboard_dir: str | os.PathLike | None = None,
        config: dict | None = None,
    ):
        # Checked on every rank so that all ranks fail alike, not rank 0 alone.
        if tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "--tensorboard-dir was given but the 'tensorboard' package is not installed: "
                "`pip install tensorboard`, or drop --tensorboard-dir"
            )
        self.enabled = rank == 0
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.total_steps = total_steps
        self.wandb_mode = resolve_wandb_mode(wandb_project if self.enabled else None, wandb_mode)
        self._step_times: collections.deque[float] = collections.deque(maxlen=ETA_WINDOW)
        self._last_log_time: float | None = None
        self._file = self._wandb_run = self._tb_writer = None
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        if self.wandb_mode != "disabled":
            self._wandb_run = self._init_wandb(wandb_project, wandb_run_name, config)
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_writer = SummaryWriter(log_dir=str(tensorboard_dir))

    def _init_wandb(self, project: str, name: str | None, config: dict | None):
        import wandb

        kwargs = dict(project=project, name=name, dir=str(self.output_dir), config=config)
        try:
            return wandb.init(mode=self.wandb_mode, **kwargs)
        except Exception as e:  # an online init that cannot reach the server
            if self.wandb_mode != "online":
                raise
            logger.warning("wandb.init (online) failed (%s); logging W&B offline instead", e)
            self.wandb_mode = "offline"
            return wandb.init(mode="offline", **kwargs)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` of optimizer step ``step`` everywhere (rank 0 only)."""
        if not self.enabled:
            return
        if "step" in metrics:
            raise ValueError("'step' is given as log()'s argument, not as a metric")
        values = {k: _number(k, v) for k, v in metrics.items()}
        record: dict[str, Any] = {"step": int(step)}
        for k in sorted(values):
            v = values[k]
            record[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

        numeric = {k: v for k, v in values.items() if v is not None}
        if self._wandb_run is not None:
            self._wandb_run.log(numeric, step=int(step))
        if self._tb_writer is not None:
            for k, v in numeric.items():
                self._tb_writer.add_scalar(k, v, global_step=int(step))
            self._tb_writer.flush()
        print(self.progress_line(step, values), flush=True)

    def progress_line(self, step: int, metrics: dict[str, Any]) -> str:
        """The one-line summary of a step; updates the moving average behind the ETA."""
        now = time.perf_counter()
        step_s = metrics.get("time/step_s")
        if step_s is None and self._last_log_time is not None:
            step_s = now - self._last_log_time  # fallback: wall time between log() calls
        self._last_log_time = now
        if step_s is not None and math.isfinite(step_s):
            self._step_times.append(float(step_s))

        if self.total_steps is not None:
            width = len(str(self.total_steps)) + 2
            parts = [f" step {step:>{width}}/{self.total_steps}"]
        else:
            parts = [f" step {step:>6}"]
        for key, label in _PROGRESS:
            v = metrics.get(key)
            if v is None:
                continue
            if key == "kl/step_scale" and metrics.get("kl/predicted") is not None:
                parts[-1] += f" {label} {_fmt(v)}"  # η joins the kl/pred field
            else:
                parts.append(f"{label} {_fmt(v)}")
        skipped = metrics.get("optimizer/skipped_steps")
        if skipped:  # the updates of this step that were not applied (non-finite)
            total = metrics.get("optimizer/skipped_steps_total", skipped)
            parts.append(f"SKIPPED {_fmt(skipped)} update(s), {_fmt(total)} in all")
        if metrics.get("throughput/tokens_per_s") is not None:
            parts.append(f"{_si(metrics['throughput/tokens_per_s'])} tok/s")
        if metrics.get("memory/peak_bytes") is not None:
            parts.append(f"mem {metrics['memory/peak_bytes'] / 2**30:.1f} GiB")
        if self.total_steps is not None and self._step_times:
            mean = sum(self._step_times) / len(self._step_times)
            left = max(self.total_steps - step, 0) * mean
            parts.append(f"ETA {datetime.timedelta(seconds=round(left))}")
        return " | ".join(parts)

    def truncate_after(self, step: int) -> None:
        """Keep only the records of steps ``<= step`` (call at resume from step ``step``).
        Lines that are not a record with an integer ``step`` (a line torn by a crash, an
        edit) are moved, as they were, to ``metrics.rejected.jsonl`` beside it, and named on
        stdout: nothing is dropped silently."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError("truncate_after() on a closed MetricsLogger")
        kept, rejected = [], []
        for number, line in enumerate(self.path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            ok = isinstance(record, dict) and type(record.get("step")) is int
            if not ok:
                rejected.append((number, line))
            elif record["step"] <= step:
                kept.append(record)
        if rejected:
            side = self.path.with_name("metrics.rejected.jsonl")
            with open(side, "a") as f:
                f.writelines(line + "\n" for _, line in rejected)
            numbers = ", ".join(str(n) for n, _ in rejected[:10])
            print(
                f"{self.path}: {len(rejected)} line(s) without a record of an integer step "
                f"(line {numbers}{', ...' if len(rejected) > 10 else ''}) moved to {side}",
                flush=True,
            )
        self._file.close()
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
        self._step_times.clear()
        self._last_log_time = None

    def close(self) -> None:
        """Finish the W&B run, close TensorBoard and the JSONL file; idempotent."""
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
