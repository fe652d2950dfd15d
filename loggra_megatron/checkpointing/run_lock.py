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
guards the directory. Only the process that took them holds the locks: a ``flock`` belongs to
the open file, which ``fork`` shares, so every forked child (the checkpoint writer processes)
closes its copies of the lock descriptors at once (``_close_in_child``); a child outliving a
killed run would otherwise keep the directory locked. A refusal names the holder's pid and
command line where this host can see it (``/proc/locks``).

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

_HELD: set[int] = set()
"""The descriptors of the run locks this process holds."""


def _close_in_child() -> None:
    """After ``fork``, in the child: close its copies of the lock descriptors. The parent's
    locks stay (a ``flock`` lasts while any descriptor of its open file does; ``lockf`` locks
    are never inherited)."""
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


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
            seen = "".join(f"; {who}" for who in lock_holders(path))
            raise ConfigError(
                f"{flag} {directory!r} is in use by another live run ({holder}{seen}); wait "
                f"until it ends (its lock {path} is released then, even after kill -9), or "
                f"choose another {flag}"
            ) from None
        dir_fd = _lock_directory(directory)
        if dir_fd is False:
            os.close(fd)
            who = ", ".join(lock_holders(directory)) or "a process this host cannot see"
            raise ConfigError(
                f"{flag} {directory!r} is locked by {who}, which holds the lock of the "
                f"directory itself but not its lock file {path}; wait until it ends, or choose "
                f"another {flag}"
            )
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        _HELD.update(d for d in (fd, dir_fd) if d is not None)
        return cls(directory, fd, dir_fd)

    def release(self) -> None:
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                _HELD.discard(fd)
                os.close(fd)  # closing the descriptor releases its lock
                setattr(self, name, None)


def lock_holders(path: str) -> list[str]:
    """``pid N (its command line)`` of each process of this host that holds a lock on
    ``path`` (``/proc/locks``); empty where none is seen (another host, no ``/proc``)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = {int(r[4]) for r in rows if len(r) > 5 and r[5] == inode and r[4].isdigit()}
    return [f"pid {pid} ({_command_line(pid)})" for pid in sorted(pids)]


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return "ended"
    text = " ".join(b" ".join(args).decode(errors="replace").split())  # one line
    return (text[:160] + "...") if len(text) > 160 else text


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
