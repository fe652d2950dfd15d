"""Tiny multi-process test harness for running real Megatron-Core on CPU (gloo).

* ``run_distributed`` runs ``fn(rank, *args, **kwargs)`` in ``world_size`` worker
  processes (forked from a forkserver that imported torch and Megatron once), each with
  ``enable_cpu_megatron``, a gloo process group, Megatron's
  model-parallel groups (``tp``, ``pp``; DP is the rest) and Megatron's RNG seeded; it returns
  the per-rank results in rank order and raises with every failing rank's traceback or on a
  hang. ``fn`` must be importable by name (module level in an importable module).
* ``tiny_gpt_model`` builds a small Llama-style Megatron-Core ``GPTModel`` for this rank's
  pipeline stage; ``wrap_ddp`` wraps it in Megatron's ``DistributedDataParallel``.
* ``train_step`` runs one step over microbatches with Megatron's
  ``get_forward_backward_func`` (1F1B when PP > 1) plus an optimizer step.

Details (costs, what travels back, the model's architecture): docs/cpu.md#the-test-harness
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from loggra_megatron.model.build import wrap_ddp
from loggra_megatron.model.forward import positions_like
from loggra_megatron.parallel import initialize_megatron

__all__ = [
    "forkserver_context",
    "rank_environment",
    "rendezvous_port",
    "run_distributed",
    "tensor_bytes_left_in_cycles",
    "tiny_gpt_model",
    "train_step",
    "wrap_ddp",
]


# Imported once by the forkserver; workers fork from it instead of re-importing (slow).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "loggra_megatron.cpu",
    # what pretrain_rl.py and the tools import, for scripts launched from the same server
    "loggra_megatron.arguments",
    "loggra_megatron.train.trainer",
    "loggra_megatron.train.generation_worker",
    "loggra_megatron.placement",
]


def _mp_context(start_method: str):
    if start_method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        return forkserver_context()
    return mp.get_context("spawn")


def forkserver_context():
    """The multiprocessing context whose processes fork from a server that imported torch,
    Megatron-Core and the trainer once (the server starts at the first process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # only takes effect before the server starts
    return ctx


def _exit_when_orphaned(ppid: int) -> None:
    while os.getppid() == ppid:  # the forkserver dies with the caller; spawn's parent is it
        time.sleep(1.0)
    os._exit(1)


RENDEZVOUS_PORTS = range(20000, 32000)
"""The ports the test launches rendezvous on (``MASTER_PORT``): below Linux's ephemeral range
(32768-60999 by default), from which the kernel numbers the sockets it picks a port for
(gloo's connections of a test running beside, any client). A port the kernel handed out, on
the contrary, could be taken between its choice and rank 0's listen. Each pytest-xdist worker
draws from its own share."""

_share_walk: collections.deque[int] = collections.deque()


def rendezvous_port() -> int:
    """A port of this process's share of ``RENDEZVOUS_PORTS`` that nothing listens on now:
    successive calls walk the share (from a point set by the pid, for a second pytest run
    beside), skipping ports that are in use."""
    if not _share_walk:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
        _share_walk.extend(RENDEZVOUS_PORTS[worker % workers :: workers])
        _share_walk.rotate(-(os.getpid() % len(_share_walk)))
    for _ in range(len(_share_walk)):
        port = _share_walk[0]
        _share_walk.rotate(-1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"every port of {RENDEZVOUS_PORTS} is in use")


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun gives rank ``rank`` of a one-node world on ``port`` (the variables
    ``torch.distributed``'s ``env://`` rendezvous and the trainer read)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def _kill_tree(p) -> None:
    """SIGKILL worker ``p`` and its process group (the worker made itself a group leader)."""
    if p.is_alive():
        p.kill()
    if hasattr(os, "killpg"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def _worker(
    rank, world_size, port, tp, pp, seed, timeout, fn, args, kwargs, out_dir, status_q, env, cwd
):
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)  # own process group, so run_distributed can clean up after us
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    # A forkserver child inherits the server's environment and cwd, not the caller's.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(rank_environment(rank, world_size, port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    error = None
    try:
        initialize_megatron(tp, pp, seed, device="cpu", timeout_s=timeout)
        result = fn(rank, *args, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        error = traceback.format_exc()
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass
    status_q.put((rank, error))


def _collect(procs, status_q, timeout: float) -> tuple[set[int], dict[int, str]]:
    """Wait for every rank's (rank, error) report; notice ranks that die without one. After
    the first failure the others get a few seconds to report before the caller kills them."""
    done: set[int] = set()
    errors: dict[int, str] = {}
    deadline, grace = time.monotonic() + timeout, float("inf")

    def record(rank: int, err: str | None) -> None:
        nonlocal grace
        done.add(rank)
        if err is not None:
            errors[rank] = err
            grace = min(grace, time.monotonic() + 5.0)

    while len(done) < len(procs) and time.monotonic() < min(deadline, grace):
        try:
            record(*status_q.get(timeout=0.2))
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
        if dead:
            with contextlib.suppress(queue.Empty):  # a report written before exiting is queued
                while True:
                    record(*status_q.get(timeout=0.5))
            for r in dead:  # segfault, os._exit, OOM kill, ...
                if r not in done:
                    record(r, f"process exited with code {procs[r].exitcode} without reporting")
    return done, errors


PORT_ATTEMPTS = 3
"""Launches tried when the rendezvous port was taken between ``rendezvous_port`` and the
bind (a process that chose the same port, e.g. in a second pytest run): nothing ran yet."""


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port (EADDRINUSE)."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    seed: int = 1234,
    timeout: float = 300.0,
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` CPU/gloo ranks; return the results.

    ``tp``/``pp`` are the tensor/pipeline model-parallel sizes (DP = world_size / (tp * pp)).
    Raises ``RuntimeError`` with the workers' tracebacks if any rank fails, and
    ``TimeoutError`` (after killing the workers) if they do not finish within ``timeout`` s.
    ``start_method`` is ``"forkserver"`` (default: workers fork from a server that imported
    torch and Megatron once, saving ~5-10 s per call) or ``"spawn"``.
    """
    if world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp={tp * pp}")
    attempts = PORT_ATTEMPTS
    while True:
        try:
            return _launch(fn, world_size, args, tp, pp, seed, timeout, start_method, kwargs)
        except _PortTaken:
            attempts -= 1
            if not attempts:
                raise


def _launch(fn, world_size, args, tp, pp, seed, timeout, start_method, kwargs) -> list[Any]:
    """One launch of ``run_distributed``'s ranks on a fresh port."""
    ctx = _mp_context(start_method)
    status_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="loggra_dist_") as out_dir:
        port = rendezvous_port()
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    port,
                    tp,
                    pp,
                    seed,
                    timeout,
                    fn,
                    args,
                    kwargs,
                    out_dir,
                    status_q,
                    dict(os.environ),
                    os.getcwd(),
                ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            done, errors = _collect(procs, status_q, timeout)
        finally:
            for r, p in enumerate(procs):
                if r not in done:  # hung (e.g. in a collective with a failed peer) or timed out
                    _kill_tree(p)
            for p in procs:
                p.join(timeout=10.0)
                _kill_tree(p)  # stragglers, and helpers a worker left behind (checkpoint writers)
                p.join()
        missing = sorted(set(range(world_size)) - done)
        if errors:
            msg = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            if missing:
                msg += f"\n(ranks {missing} were still running and were killed)"
            taken = "EADDRINUSE" in msg and "server socket has failed to listen" in msg
            error = _PortTaken if taken else RuntimeError
            raise error(f"run_distributed: {len(errors)} rank(s) failed:\n{msg}")
        if missing:
            raise TimeoutError(f"run_distributed: ranks {missing} did not finish in {timeout} s")
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


def tiny_bf16_gpt_model(**shape: Any):
    """``tiny_gpt_model`` entirely in bf16 (norms included, CPU-initialized), wrapped in
    Megatron's ``Float16Module``: what the distributed optimizer keeps fp32 masters of."""
    model = tiny_gpt_model(
        **shape,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )
    model.bfloat16()
    return model


def tiny_gpt_model(
    num_layers: int = 2,
    hidden_size: int = 32,
    heads: int = 4,
    vocab: int = 64,
    seq: int = 16,
    query_groups: int | None = None,
    share_embeddings: bool = False,
    bf16: bool = False,
    ffn_hidden_size: int | None = None,
    kv_channels: int | None = None,
    **config_overrides: Any,
):
    """A tiny Llama-style Megatron-Core ``GPTModel`` for this rank's pipeline stage, built by
    ``loggra_megatron.model.build_gpt_model`` (local spec, RMSNorm, SwiGLU with FFN
    ``2·hidden`` by default, RoPE, no dropout, unpadded vocabulary).

    ``bf16=True`` makes bf16 parameters wrapped in Megatron's ``Float16Module`` (pair it with
    ``OptimizerConfig(bf16=True)``: the distributed optimizer then keeps fp32 main params).
    ``config_overrides`` are ``TransformerConfig`` fields (e.g. ``use_cpu_initialization``).
    """
    from megatron.core.transformer.module import Float16Module

    from loggra_megatron.model.args import GPTModelArgs
    from loggra_megatron.model.build import build_gpt_model

    args = GPTModelArgs(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size or 2 * hidden_size,
        num_attention_heads=heads,
        num_query_groups=query_groups,
        kv_channels=kv_channels,
        vocab_size=vocab,
        make_vocab_size_divisible_by=1,
        max_position_embeddings=seq,
        untie_embeddings_and_output_weights=not share_embeddings,
        params_dtype="bfloat16" if bf16 else "float32",
    )
    model = build_gpt_model(args, **config_overrides)
    return Float16Module(model.config, model) if bf16 else model


def _gpt_forward_step(data_iterator, model):
    batch = next(data_iterator)
    x = batch["tokens"][:, :-1]
    losses = model(x, positions_like(x), None, labels=batch["tokens"][:, 1:])  # [b, s]

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return losses, loss_func


def train_step(
    model, optimizer, tokens: torch.Tensor, num_microbatches: int = 1, forward_only: bool = False
):
    """One step on ``tokens`` ([batch, seq + 1] ints, split into ``num_microbatches``).

    Uses Megatron's ``get_forward_backward_func`` (1F1B for PP > 1). Returns
    ``(mean_loss, (update_successful, grad_norm, num_zeros))``; ``mean_loss`` is None on
    non-last pipeline stages, the optimizer tuple is None when ``forward_only``.
    """
    from loggra_megatron.model.forward import run_schedule

    batch = tokens.shape[0]
    assert batch % num_microbatches == 0
    mbs = batch // num_microbatches
    micro = [{"tokens": tokens[i : i + mbs]} for i in range(0, batch, mbs)]
    if not forward_only:
        model.zero_grad_buffer()
        optimizer.zero_grad()
    out = run_schedule(model, _gpt_forward_step, micro, forward_only=forward_only)
    loss = torch.stack([d["lm loss"] for d in out]).mean().item() if out else None
    return loss, None if forward_only else optimizer.step()


def tensor_bytes_left_in_cycles(run: Callable[[], Any]) -> int:
    """Bytes of the tensors that ``run()`` leaves in reference cycles: garbage that only
    Python's cyclic collector frees, at a time of its choosing (a KV cache in such a cycle
    outlives its rollout into the training phase, and piles up step after step)."""
    import gc

    gc.collect()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
        return sum(t.untyped_storage().nbytes() for t in found if t.layout == torch.strided)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
