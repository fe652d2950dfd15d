"""One live run per directory.

Rank 0 of ``pretrain_rl.py`` holds a POSIX record lock (``fcntl.lockf``) on
``DIR/pretrain_rl.lock`` in every directory the run writes (``--save`` and the output
directory of ``metrics.jsonl``), from the end of its start-up checks until the process ends.
The kernel (or the NFS lock manager) releases the lock whenever its holder ends, kill -9
included, so the lock of a crashed run is stale by construction and the next run takes it;
a second run while the first is alive (a scheduler's requeue race starting the same
auto-resume command twice) is refused with exit status 2, naming the holder. The file's
text (host, pid, start time of the holder) is only for that message. Because a cleanup
script may delete the file under a live run (a second run would then lock a new file),
rank 0 also holds an exclusive ``flock`` on the directory itself, which no unlink can take
away; where the file system has no ``flock`` for directories (NFS), the file lock alone
guards the directory.

Once it holds the lock, a run checks that the directory is as it was when its start was
planned (``directory_state``: another run may have saved or logged in between; the
command is then refused, and running it again plans from what is there), and removes the
interrupted saves (``iter_N.tmp`` without a manifest) that a killed run left behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from loggra_megatron.checkpointing.config import CheckpointConfig
from loggra_megatron.checkpointing.layout import (
    candidates,
    read_tracker,
    remove_interrupted_saves,
)
from loggra_megatron.config import ConfigError
from loggra_megatron.metrics import LoggingConfig

LOCK_FILE = "pretrain_rl.lock"


def directory_state(directory: str) -> tuple:
    """What a run's start plan depends on in ``directory``: the tracker, the iteration
    directories and the size of ``metrics.jsonl``."""
    from loggra_megatron.metrics import METRICS_FILE

    metrics = os.path.join(directory, METRICS_FILE)
    size = os.path.getsize(metrics) if os.path.isfile(metrics) else None
    names = tuple(os.path.basename(path) for _, path in candidates(directory))
    return read_tracker(directory), names, size


class RunLock:
    """The lock of one directory, held by this process until ``release`` or its end."""

    def __init__(self, directory: str, fd: int, dir_fd: int | None):
        self.directory, self._fd, self._dir_fd = directory, fd, dir_fd

    @classmethod
    def acquire(cls, directory: str, flag: str) -> RunLock:
        """Take the lock of ``directory`` (created if needed), or raise ``ConfigError``
        naming the live run that holds it."""
        path = os.path.join(directory, LOCK_FILE)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"{flag} {directory!r}: cannot create {path} ({e})") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise ConfigError(f"{flag} {directory!r}: cannot lock {path} ({e})") from None
            raise ConfigError(
                f"{flag} {directory!r} is in use by another live run ({holder}); wait until it "
                f"ends (its lock {path} is released then, even after kill -9), or choose "
                f"another {flag}"
            ) from None
        dir_fd = _lock_directory(directory)
        if dir_fd is False:
            os.close(fd)
            raise ConfigError(
                f"{flag} {directory!r} is in use by another live run: its lock file {path} was "
                "deleted, the directory itself is still locked; wait until that run ends, or "
                f"choose another {flag}"
            )
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        return cls(directory, fd, dir_fd)

    def release(self) -> None:
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)  # closing the descriptor releases its lock
                setattr(self, name, None)


def _lock_directory(directory: str) -> int | None | bool:
    """An exclusive ``flock`` on ``directory`` itself: its descriptor, False if another
    process holds it, None where directories cannot be flocked (e.g. NFS)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(dir_fd)
        return False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    return dir_fd


def written_directories(checkpoint: CheckpointConfig, logging: LoggingConfig) -> dict[str, str]:
    """``{real path: flag}`` of the directories a run writes: ``--save`` and the output
    directory of ``metrics.jsonl``."""
    metrics_dir = os.path.realpath(logging.metrics_dir(checkpoint.save))
    out = {metrics_dir: "--output-dir" if logging.output_dir else "--save"}
    if checkpoint.save is not None:
        out[os.path.realpath(checkpoint.save)] = "--save"
    return out


def claim_run_directories(
    checkpoint: CheckpointConfig, logging: LoggingConfig, seen: dict[str, tuple], notes: list[str]
) -> list[RunLock]:
    """Rank 0, after the start-up checks: lock every directory the run writes, refuse the
    run if one changed since its start was planned (``seen``: ``StartPlan.seen``), and
    remove interrupted saves from ``--save`` (a note for each). Raises ``ConfigError``; on
    success the locks are held."""
    locks: list[RunLock] = []
    try:
        for directory, flag in written_directories(checkpoint, logging).items():
            locks.append(RunLock.acquire(directory, flag))
            if directory_state(directory) != seen[directory]:
                raise ConfigError(
                    f"{flag} {directory!r} changed while this run started (another run saved "
                    "or logged there); run the command again to plan from what is there now"
                )
    except ConfigError:
        for lock in locks:
            lock.release()
        raise
    if checkpoint.save is not None:
        for path in remove_interrupted_saves(checkpoint.save):
            notes.append(f"removed the interrupted save {path}")
    return locks
