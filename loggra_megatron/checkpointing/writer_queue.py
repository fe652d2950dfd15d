"""Megatron-Core's checkpoint writer results queue, as this project starts it.

Megatron's ``torch_dist`` writers (processes forked from the rank at each save) report
through a queue of a ``multiprocessing`` Manager that Megatron spawns on first use
(``filesystem_async._results_queue``, megatron-core 0.16-0.19). This module starts that
server instead, with three differences:

* **It dies with its rank.** Megatron's server outlived a killed rank forever; this one has
  a watchdog thread (``exit_with_parent``) that ends it once the rank is gone, SIGKILL
  included.
* **It holds bytes.** A Manager's server unpickles every item it stores, so a write result
  made it import torch. ``PickledQueue`` pickles in the writer and unpickles in the rank.
* **It starts as** ``python -m`` **this module**, which imports the standard library only.
  ``multiprocessing``'s ``spawn`` first imports the rank's main script in the new process
  (``pretrain_rl.py``, and with it torch), then the module of the server's initializer.

Measured on 2 CPU cores, 2026-12-07: a tiny model's save left the spawned server (with its
watchdog beside the checkpoint code, which imports Megatron-Core) at 375 MiB resident after
5.7 s of CPU; this one at 20 MiB after 0.08 s. A 2-step, 2-rank tiny ``pretrain_rl.py`` run
with ``--save`` took 6.4 s with the former, 2.3 s with this one (1.7 s without ``--save``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.managers import SyncManager

POLL_S = 1.0
"""Seconds between two looks at the parent."""


def exit_with_parent() -> None:
    """A daemon thread that ends this process (the server) once its parent (the training
    rank) is gone, even after a SIGKILL."""

    def watch(ppid: int) -> None:
        while os.getppid() == ppid:
            time.sleep(POLL_S)
        os._exit(0)

    threading.Thread(target=watch, args=(os.getppid(),), daemon=True).start()


class PickledQueue:
    """A Manager's queue that carries pickled bytes: ``put`` pickles in the writer process,
    ``get_nowait`` unpickles in the rank, so the server stores bytes it never unpickles.
    These two are what Megatron's writers and its save finalization call (0.16-0.19)."""

    def __init__(self, queue) -> None:
        self._queue = queue

    def put(self, item, *args, **kwargs) -> None:
        self._queue.put(pickle.dumps(item), *args, **kwargs)

    def get_nowait(self):
        return pickle.loads(self._queue.get_nowait())  # noqa: S301 (our own writers')


def install_writer_queue() -> None:
    """Give Megatron's writers this process's results queue, once (before its first save): a
    ``PickledQueue`` on a server of its own that dies with this process. A Megatron-Core
    without that queue is left as it is."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = PickledQueue(_start_server().Queue())


def _start_server() -> SyncManager:
    """The queue server, ``python -m`` this module, connected: not ``multiprocessing``'s
    ``spawn``, which imports the rank's main script (``pretrain_rl.py``, and with it torch)
    in the new process first. Its authkey is this process's, as a spawned server's would be
    (the processes that inherit it can use the queue)."""
    authkey = bytes(mp.current_process().authkey)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    server = subprocess.Popen(
        [sys.executable, "-m", __name__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},  # this package, installed or not
    )
    server.stdin.write(authkey)
    server.stdin.close()
    address = server.stdout.readline().decode().strip()
    if not address:
        raise RuntimeError(f"the checkpoint writer-queue server exited {server.wait()}")
    manager = SyncManager(address=address, authkey=authkey)
    manager.connect()
    manager.server_process = server  # kept: it serves until this process is gone
    return manager


def _serve() -> None:
    """The server: its authkey from stdin, its address (a Unix socket) to stdout, then it
    serves until its parent is gone."""
    authkey = sys.stdin.buffer.read()
    exit_with_parent()
    server = SyncManager(authkey=authkey).get_server()
    print(server.address, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    _serve()
