"""Training metrics: JSONL file, W&B, TensorBoard and one progress line per step (rank 0).

``MetricsLogger(output_dir, rank=...)`` is built on every rank; only rank 0 writes, the
others get a no-op logger (no file, no W&B run, no output). Each ``log(step, metrics)``
appends one JSON object to ``output_dir/metrics.jsonl`` (``step`` first, then the keys
sorted; a non-finite value as ``null``; fsync-ed per line), gives the values as they are to
W&B and TensorBoard, and prints one Megatron-like progress line. A line that cannot be
written (a full disk) is cut off the file again and stops the run (``MetricsWriteError``,
which names the checkpoint to resume from). ``resolve_wandb_mode`` picks the W&B mode
without probing the network; ``truncate_after(k)`` at a resume makes the file of a resumed
run equal that of an uninterrupted one, moving the lines it cannot keep (torn, not UTF-8,
a step recorded twice) aside. Keys, their meaning and how they are reduced over ranks and
updates: ``metric_keys``.

The file format, the progress line, the W&B mode rules and resume: docs/metrics.md
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import importlib.util
import json
import logging
import math
import netrc
import os
import time
import warnings
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


def _numbered_lines(path: Path) -> list[tuple[int, bytes]]:
    """``(line number, bytes)`` of each non-blank line (bytes: a line need not be UTF-8)."""
    lines = enumerate(path.read_bytes().split(b"\n"), start=1)
    return [(number, line) for number, line in lines if line.strip()]


def _parse(line: bytes) -> Any:
    """The JSON value of a line; ValueError if it is not UTF-8 JSON."""
    return json.loads(line.decode("utf-8"))


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and type(value.get("step")) is int


def _repeated_steps(records: list[tuple[int, dict]]) -> dict[int, list[int]]:
    """``{step: its line numbers}`` of each step recorded more than once (logged again, e.g.
    by a resume that did not truncate); the record of its last line is the one kept."""
    lines: dict[int, list[int]] = {}
    for number, record in records:
        lines.setdefault(record["step"], []).append(number)
    return {step: numbers for step, numbers in lines.items() if len(numbers) > 1}


def _repeated_note(path: Path, repeated: dict[int, list[int]]) -> str:
    shown = "; ".join(
        f"step {step} at lines {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"
        for step, numbers in list(repeated.items())[:10]
    )
    more = ", ..." if len(repeated) > 10 else ""
    return f"{path}: {len(repeated)} step(s) recorded more than once ({shown}{more})"


def _replaced_lines(repeated: dict[int, list[int]]) -> set[int]:
    return {number for numbers in repeated.values() for number in numbers[:-1]}


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``metrics.jsonl`` (or of a directory holding one); ``null`` stays None.

    A final line cut short by a crash is ignored; any other line that is not UTF-8 JSON
    raises ValueError naming it. Of a step recorded more than once, the last record is kept,
    with a warning."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = _numbered_lines(path)
    values = []
    for i, (number, line) in enumerate(lines):
        try:
            values.append((number, _parse(line)))
        except ValueError as e:
            if i != len(lines) - 1:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
    repeated = _repeated_steps([(n, v) for n, v in values if _is_record(v)])
    if repeated:
        warnings.warn(f"{_repeated_note(path, repeated)}: kept the last", stacklevel=2)
    replaced = _replaced_lines(repeated)
    return [value for number, value in values if number not in replaced]


class MetricsWriteError(RuntimeError):
    """``metrics.jsonl`` could not be written (a full disk); the run stops. Raised on rank 0
    alone (the other ranks write nothing): ``pretrain_rl.py`` exits naming the checkpoint to
    resume from (``checkpointing.layout.resume_note``), and torchrun stops them."""


def _numbers(lines: list) -> str:
    """The line numbers of ``(number, ...)`` items, the first ten."""
    shown = ", ".join(str(item[0]) for item in lines[:10])
    return shown + (", ..." if len(lines) > 10 else "")


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
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed in close())
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
        self._append(step, (json.dumps(record, allow_nan=False) + "\n").encode())

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

    def _append(self, step: int, line: bytes) -> None:
        """Append ``line`` and fsync it; where that fails (a full disk), cut the file back to
        its last whole line and raise ``MetricsWriteError``."""
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        try:
            rest = memoryview(line)
            while rest:  # an unbuffered write may write part of the line
                rest = rest[self._file.write(rest) :]
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):  # else the resume moves the torn line aside
                os.ftruncate(fd, size)
            raise MetricsWriteError(
                f"--output-dir: writing step {step} to {self.path} failed ({e}); the file "
                "keeps the steps before it: free space there"
            ) from None

    def truncate_after(self, step: int) -> None:
        """Keep only the records of steps ``<= step`` (call at resume from step ``step``),
        one per step: of a step recorded more than once, the last. The lines not kept for
        that reason, and those that are not a record with an integer ``step`` (a line torn
        by a crash or a full disk, bytes that are not UTF-8, an edit), are moved, as they
        were, to ``metrics.rejected.jsonl`` beside it, and named on stdout: nothing is
        dropped silently. The file is rewritten whole, so a last line without its newline
        is repaired."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError("truncate_after() on a closed MetricsLogger")
        kept, rejected = [], []
        for number, line in _numbered_lines(self.path):
            try:
                record = _parse(line)
            except ValueError:
                record = None
            if not _is_record(record):
                rejected.append((number, line))
            elif record["step"] <= step:
                kept.append((number, line, record))
        repeated = _repeated_steps([(number, record) for number, _, record in kept])
        replaced = _replaced_lines(repeated)
        side = self.path.with_name("metrics.rejected.jsonl")
        notes = []
        if rejected:
            notes.append(
                f"{self.path}: {len(rejected)} line(s) without a record of an integer step "
                f"(line {_numbers(rejected)}) moved to {side}"
            )
        if repeated:
            moved = [(n, line) for n, line, _ in kept if n in replaced]
            notes.append(
                f"{_repeated_note(self.path, repeated)}: kept the last; line "
                f"{_numbers(moved)} moved to {side}"
            )
            rejected = sorted(rejected + moved)
        records = [record for number, _, record in kept if number not in replaced]
        self._rewrite(records, rejected, side, step)
        for note in notes:
            print(note, flush=True)
        self._step_times.clear()
        self._last_log_time = None

    def _rewrite(self, records: list[dict], rejected: list, side: Path, step: int) -> None:
        """Append the ``rejected`` lines to ``side``, and replace the file by ``records``."""
        self._file.close()
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            if rejected:
                with open(side, "ab") as f:
                    f.writelines(line + b"\n" for _, line in rejected)
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            self._file = None
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise MetricsWriteError(
                f"--output-dir: rewriting {self.path} for the resume after step {step} failed "
                f"({e}); the file is as it was: free space there"
            ) from None
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115

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
