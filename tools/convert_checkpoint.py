# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Convert Llama / Qwen2 / Qwen3 checkpoints between Hugging Face and Megatron-Core.

HF -> Megatron (a ``torch_dist`` dist checkpoint in the Megatron-LM ``release`` layout, plus
``loggra_model_args.json``)::

    python tools/convert_checkpoint.py --direction hf-to-megatron \\
        --load /models/Qwen2.5-7B --save /ckpt/qwen2.5-7b-mcore

Megatron -> HF (``config.json`` + ``model.safetensors`` or sharded files with an index)::

    python tools/convert_checkpoint.py --direction megatron-to-hf \\
        --load /ckpt/qwen2.5-7b-mcore --save /models/qwen2.5-7b-rl

Conversion runs on CPU with the gloo backend (Megatron-Core's CUDA assumptions are redirected
by ``loggra_megatron.cpu.enable_cpu_megatron``; no GPU is touched, even if present). For a
model that does not fit one process, shard it: run under ``torchrun --nproc-per-node TP*PP``
with ``--tensor-model-parallel-size TP --pipeline-model-parallel-size PP``; every rank then
holds and converts only its shard. The dist checkpoint itself is parallelism-agnostic: it
loads at any TP/PP the architecture allows.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 5GB, 500MB, 2GiB)")
    unit = m.group(2).upper()
    base = 1024 if m.group(3) and m.group(3).lower() == "ib" else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(unit or " "))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--direction", required=True, choices=["hf-to-megatron", "megatron-to-hf"])
    p.add_argument("--load", required=True, help="source checkpoint directory")
    p.add_argument("--save", required=True, help="destination directory (must be empty or new)")
    p.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="megatron-to-hf: convert this iteration of a pretrain_rl.py checkpoint (default: "
        "the tracked one, or the newest complete one when it is damaged, as --load resolves it)",
    )
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--params-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="hf-to-megatron: dtype of the Megatron parameters (default: the HF config's dtype)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="hf-to-megatron: pad the vocabulary to a multiple of this times TP",
    )
    p.add_argument(
        "--export-masters",
        action="store_true",
        help="megatron-to-hf: write the optimizer's fp32 master weights (float32) instead of "
        "the model's weights: exact where training kept bf16 weights (--bf16), whose "
        "rounding hides updates below a bf16 step; needs a LoGRA checkpoint with its "
        "optimizer state, converted at the training's TP and PP sizes",
    )
    p.add_argument(
        "--max-shard-size",
        type=_parse_size,
        default=_parse_size("5GB"),
        help="megatron-to-hf: largest safetensors file (default 5GB)",
    )
    p.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default="local",
        help="Megatron layer spec used to build the model (checkpoints are interchangeable)",
    )
    return p


def _init_distributed(tp: int, pp: int) -> bool:
    """gloo process group (torchrun's env or a single local process) + Megatron groups.

    Reuses an existing setup with the same TP/PP (``main`` called from a program that already
    initialised Megatron on CPU). Returns True if this call created the process group.
    """
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from loggra_megatron.cpu import enable_cpu_megatron
    from loggra_megatron.parallel import single_process_env

    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if have != (tp, pp):
            raise ValueError(
                f"Megatron is already initialised with (TP, PP) = {have}, not {(tp, pp)}"
            )
        return False
    single_process_env()  # plain `python tools/convert_checkpoint.py`
    enable_cpu_megatron(force=True)  # conversion is CPU-only by design
    torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    if world != tp * pp:
        raise ValueError(
            f"world size {world} must equal tensor-model-parallel-size * "
            f"pipeline-model-parallel-size = {tp} * {pp}; launch with torchrun --nproc-per-node {tp * pp}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return True


_INTERRUPTED = re.compile(
    r"^(release\.tmp|loggra_model_args\.json|hf_config\.json|.+\.tmp\.safetensors)$"
)
"""What an interrupted conversion leaves in --save: the temporary dist checkpoint or shards
(and the files written beside them before the rename that publishes the conversion)."""


def _check_destination(path: str, direction: str) -> None:
    """Refuse a --save that holds anything but the leftovers of an interrupted conversion;
    those are removed (by rank 0), as the trainer removes its interrupted saves."""
    entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
    leftovers = [e for e in entries if _INTERRUPTED.match(e)]
    if entries and len(leftovers) == len(entries) and any(".tmp" in e for e in leftovers):
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"--save {path}: removing an interrupted conversion's {', '.join(leftovers)}",
                flush=True,
            )
            _remove(path, leftovers)
        return
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise FileExistsError(
            f"--save {path} exists and is not empty ({shown}); refusing to overwrite "
            f"({direction}): give an empty or new directory"
        )


def _remove(path: str, names: list[str]) -> None:
    import shutil

    for name in names:
        target = os.path.join(path, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        else:
            os.remove(target)


def _clean_failed(path: str, existed: bool) -> None:
    """After a failed conversion (rank 0): remove its partial files, and --save itself when
    this run made it and it is empty."""
    if int(os.environ.get("RANK", "0")) != 0 or not os.path.isdir(path):
        return
    _remove(path, [n for n in os.listdir(path) if _INTERRUPTED.match(n)])
    if not existed and not os.listdir(path):
        os.rmdir(path)


def _disk_full(path: str) -> bool:
    """Whether the file system of ``path`` has (almost) no space left."""
    import shutil

    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return shutil.disk_usage(path).free < 1 << 20


def _preflight(opts) -> None:
    """Cheap checks before Megatron is imported or any process group exists: the source's
    config and file headers (HF) or the checkpoint's selection and file sizes (Megatron)."""
    from loggra_megatron.checkpointing.layout import select_model_checkpoint
    from loggra_megatron.convert.checkpoint import read_model_args
    from loggra_megatron.convert.hf_config import gpt_args_from_hf
    from loggra_megatron.convert.hf_io import HFCheckpointReader
    from loggra_megatron.convert.hf_to_megatron import validate_hf_checkpoint
    from loggra_megatron.convert.masters import check_masters

    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError("parallel sizes must be >= 1")
    if opts.direction == "hf-to-megatron":
        for flag, given in (
            ("--ckpt-step", opts.ckpt_step is not None),
            ("--export-masters", opts.export_masters),
        ):
            if given:
                raise ValueError(f"{flag} applies to --direction megatron-to-hf")
        args = gpt_args_from_hf(opts.load)  # refuses unsupported architectures
        with HFCheckpointReader(opts.load) as reader:  # every shard's header, tensor shapes
            validate_hf_checkpoint(reader, args)
    else:
        ref = select_model_checkpoint(opts.load, opts.ckpt_step)  # warnings: when loaded
        args = read_model_args(opts.load)
        if opts.export_masters:
            check_masters(ref.path, tp, pp)
    if args.num_layers % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} does not divide the model's "
            f"{args.num_layers} layers"
        )
    for name, count in (
        ("attention heads", args.num_attention_heads),
        ("key/value heads", args.num_query_groups or args.num_attention_heads),
    ):
        if count % tp:
            raise ValueError(
                f"--tensor-model-parallel-size {tp} does not divide the model's {count} {name}"
            )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * pp:
        raise ValueError(
            f"world size {world} must equal --tensor-model-parallel-size × "
            f"--pipeline-model-parallel-size = {tp} × {pp}; launch with torchrun "
            f"--nproc-per-node {tp * pp}"
        )
    _check_destination(opts.save, opts.direction)


def _convert(opts, log):
    """The conversion ``opts.direction`` asks for; returns the model's ``GPTModelArgs``."""
    from loggra_megatron.convert import convert_hf_to_megatron, convert_megatron_to_hf

    use_te = opts.transformer_impl == "transformer_engine"
    if opts.direction == "hf-to-megatron":
        overrides = {"make_vocab_size_divisible_by": opts.make_vocab_size_divisible_by}
        if opts.params_dtype is not None:
            overrides["params_dtype"] = opts.params_dtype
        return convert_hf_to_megatron(opts.load, opts.save, use_te=use_te, log=log, **overrides)
    return convert_megatron_to_hf(
        opts.load,
        opts.save,
        max_shard_bytes=opts.max_shard_size,
        use_te=use_te,
        log=log,
        iteration=opts.ckpt_step,
        masters=opts.export_masters,
    )


def _failed(opts, error: Exception, full: bool, existed: bool) -> int:
    """A refused conversion (exit 2) or a write that failed for want of space (an OSError,
    safetensors' error, or the dist checkpoint writer's "unexpected pos"; exit 1): one line,
    and no partial files."""
    message = " ".join(str(error).split())
    if full:
        message = (
            f"writing --save {opts.save} failed, its file system is full "
            f"({type(error).__name__}: {message[:200]}); the partial files were removed: "
            "free space and run the same command again"
        )
    print(f"error: {message}", file=sys.stderr, flush=True)
    _clean_failed(opts.save, existed)
    return 1 if full else 2


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    t0 = time.perf_counter()
    existed = os.path.isdir(opts.save)
    try:
        _preflight(opts)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2

    from loggra_megatron.library_notes import quiet_benign_warnings

    quiet_benign_warnings()  # before Megatron-Core is imported: it warns on import
    import torch
    from megatron.core import parallel_state

    from loggra_megatron.checkpointing import CheckpointError
    from loggra_megatron.megatron_version import untested_version_note

    if torch.distributed.is_initialized():  # reused group: no rank writes before all checked
        torch.distributed.barrier()
    owns_group = False
    try:
        owns_group = _init_distributed(tp, pp)
        rank = torch.distributed.get_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()

        def log(msg: str) -> None:
            if tp_rank == 0:
                print(f"[pp {pp_rank}] {msg}" if pp > 1 else msg, flush=True)

        if rank == 0:
            print(f"{opts.direction}: {opts.load} -> {opts.save} (TP={tp}, PP={pp})", flush=True)
            if (note := untested_version_note()) is not None:
                print(note, file=sys.stderr, flush=True)
        args = _convert(opts, log)
        if rank == 0:
            print(
                f"done: {args.num_layers} layers, hidden {args.hidden_size}, "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        return 0
    except Exception as e:
        full = _disk_full(opts.save)
        refused = (ValueError, FileNotFoundError, FileExistsError, KeyError, CheckpointError)
        if not full and not isinstance(e, refused):
            raise
        return _failed(opts, e, full, existed)
    finally:
        if owns_group:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
