# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""What ``tools/estimate_memory.py --fit`` prints (``fit_report``, ``fit_json``): the
search and the launch environment it assumes (``launch_environment``), then per optimizer
the best fitting configurations with their totals, free memory, rollout rows at once and the
flags that launch them, or the closest one and by how much it is over."""

from __future__ import annotations

import textwrap

from loggra_megatron.memory.fit import OPTIMIZER_NAMES, FitResult, Outcome
from loggra_megatron.memory.shape import GiB
from loggra_megatron.optim.registry import backward_sketch

__all__ = ["fit_json", "fit_report", "launch_environment"]

HEADER = (
    f"{'':>3}{'TP':>4}{'PP':>4}{'DP':>4}  {'recompute':<10}{'mb':>3}  {'grads':<6}"
    f"{'masters':<8}{'total':>7}{'free':>8}{'rows at once':>18}{'KV rows':>9}"
)
GENERATION_COLUMN = f"{'gen GPU':>9}"
"""With ``--generation-ranks``: a generation GPU's total, after the training GPU's."""


def launch_environment(est) -> dict[str, str]:
    """The allocator and NCCL environment the estimate assumes, as a launch exports it
    (``est``: the EstimateConfig; ``--expandable-segments``, ``--no-nccl-nvls``)."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{est.expandable_segments}",
        "NCCL_NVLS_ENABLE": "1" if est.nccl_nvls else "0",
    }


def _choices(values: list) -> str:
    return "|".join(str(v) for v in values)


def _describe(result: FitResult, source: str, est) -> list[str]:
    space, gpus_per_node = result.space, est.gpus_per_node
    nodes = result.world / gpus_per_node
    onoff = {(False,): "off", (True,): "on", (False, True): "off|on"}
    rec = {"given": "as given", "none": "none", "full": "full (uniform, 1 layer)"}
    counts = ", ".join(
        f"{OPTIMIZER_NAMES[k]} {len(result.fitting(k))} of {len(v)} fit"
        for k, v in result.outcomes.items()
    )
    tried = len(result.outcomes["loggra"]) + len(result.refused)
    lines = [
        f"fit       {source} on {nodes:g} node{'' if nodes == 1 else 's'} x {gpus_per_node} "
        f"GPUs (world {result.world})"
        f" of {result.gpu_bytes / GiB:g} GiB, {_gib(result.gpu_bytes - result.budget_bytes)} "
        "GiB kept free",
        f"searched  TP {_choices(space['tp'])} (within a node) x PP (dividing the rest), "
        "sequence parallel with TP > 1,",
        f"          recompute {'|'.join(rec[r] for r in space['recompute'])}, micro-batch "
        f"{_choices(space['micro_batch_size'])}, --grad-reduce-in-bf16 "
        f"{onoff[tuple(space['bf16_grads'])]},",
        f"          --loggra-param-remainders {onoff[tuple(space['remainders'])]}, KV budget "
        f"{'as given' if result.kv_given else 'the largest that fits'}",
        f"tried     {tried} settings, {len(result.refused)} refused by pretrain_rl.py's checks; "
        f"{counts}",
    ]
    if result.generation_ranks:  # before "tried"
        lines[-1:-1] = [
            f"placement {result.world - result.generation_ranks} GPUs train (the layouts above),"
            f" {result.generation_ranks} generate (--generation-ranks) and hold the KV cache;",
            "          a configuration fits when both do ('gen GPU': a generation GPU's total)",
        ]
    if result.refused:  # the first, as an example of the rule
        lines.append(f"          (e.g. {result.refused[0][1]})")
    env = " ".join(f"{k}={v}" for k, v in launch_environment(est).items())
    lines += [
        f"launch    {env} torchrun ... pretrain_rl.py",
        "          with this command's pretrain_rl.py flags and a configuration's flags below",
    ]
    return [*lines, ""]


def _gib(x: int) -> str:
    return f"{x / GiB:.2f}"


def _row(i: int | str, o: Outcome, gpu_bytes: int, seq: int) -> str:
    c = o.candidate
    rows = "none" if not o.rows else f"{o.rows} x {seq}"
    kv = f"{o.kv_rows}" + ("" if "--inference-max-tokens" in o.flags else " all")
    gen = "" if o.generation_bytes is None else f"{_gib(o.generation_bytes):>9}"
    return (
        f"{i!s:>3}{c.tp:>4}{c.pp:>4}{o.data_parallel_size:>4}  {c.recompute:<10}"
        f"{c.micro_batch_size:>3}  {'bf16' if c.bf16_grads else 'fp32':<6}"
        f"{'rem.' if c.remainders and o.optimizer == 'loggra' else 'fp32':<8}"
        f"{_gib(o.total_bytes):>7}{_gib(gpu_bytes - o.total_bytes):>8}{rows:>18}{kv:>9}{gen}"
    )


def _flags(o: Outcome) -> list[str]:
    text = " ".join(o.flags) or "(the command line as it is)"
    return textwrap.wrap(text, 92, initial_indent=" " * 6, subsequent_indent=" " * 8)


def _table(result: FitResult, name: str, top: int, seq: int) -> list[str]:
    fitting, tried, gpu = result.fitting(name), len(result.outcomes[name]), result.gpu_bytes
    header = HEADER + (GENERATION_COLUMN if result.generation_ranks else "")
    title = f"{OPTIMIZER_NAMES[name]} (--optimizer {name}"
    backward = backward_sketch(name, result.loggra_sketch)
    title += f" --loggra-sketch {result.loggra_sketch})" if backward else ")"
    if not fitting:
        o = result.closest(name)
        if o is None:
            return [f"{title}: nothing to try", ""]
        over, budget = _gib(o.total_bytes - gpu), _gib(result.budget_bytes)
        lines = [
            f"{title}: none of {tried} fits; the closest needs {_gib(o.total_bytes)} GiB, "
            f"{over} over the GPU ({budget} allowed):",
            header,
        ]
        return [*lines, _row("-", o, gpu, seq), *_flags(o), ""]
    best = result.best(name)[:top]
    lines = [
        f"{title}: {len(fitting)} of {tried} fit; the best of each layout and recompute, "
        "most rollout rows first:",
        header,
    ]
    for i, o in enumerate(best, 1):
        lines += [_row(i, o, gpu, seq), *_flags(o)]
    return [*lines, ""]


def fit_report(result: FitResult, source: str, est, seq: int) -> str:
    """The text ``--fit`` prints (``est``: the EstimateConfig; ``seq``: --seq-length)."""
    lines = _describe(result, source, est)
    for name in ("loggra", "adam"):
        lines += _table(result, name, est.fit_top, seq)
    lines += [
        "rows at once: rollout rows of --seq-length tokens a replica holds at once (its KV "
        "cache), at most;",
        "KV rows: those the flags launch (--inference-max-tokens / --seq-length; all: the "
        "whole rollout batch)",
    ]
    return "\n".join(lines)


def _outcome_json(o: Outcome, gpu_bytes: int) -> dict:
    c = o.candidate
    return {
        "tp": c.tp,
        "pp": c.pp,
        "dp": o.data_parallel_size,
        "sequence_parallel": c.sequence_parallel,
        "recompute": c.recompute,
        "micro_batch_size": c.micro_batch_size,
        "bf16_grads": c.bf16_grads,
        "remainders": c.remainders and o.optimizer == "loggra",
        "total": o.total_bytes / GiB,
        "free": (gpu_bytes - o.total_bytes) / GiB,
        "fits": o.fits,
        "peak_phase": o.peak_phase,
        "max_rollout_rows": o.rows,
        "generation_total": None if o.generation_bytes is None else o.generation_bytes / GiB,
        "kv_rows": o.kv_rows,
        "flags": list(o.flags),
    }


def fit_json(result: FitResult, est) -> dict:
    """The same as JSON (GiB): per optimizer the counts, the best and the closest."""
    gpu_bytes = result.gpu_bytes
    out: dict = {"unit": "GiB", "world": result.world, "refused": len(result.refused)}
    out["generation_ranks"] = result.generation_ranks
    out["loggra_sketch"] = result.loggra_sketch
    out["environment"] = launch_environment(est)
    for name, outcomes in result.outcomes.items():
        closest = result.closest(name)
        out[name] = {
            "tried": len(outcomes),
            "fit": len(result.fitting(name)),
            "best": [_outcome_json(o, gpu_bytes) for o in result.best(name)[: est.fit_top]],
            "closest": None if closest is None else _outcome_json(closest, gpu_bytes),
        }
    return out
