"""Predicted-KL step control: overhead, probe skipping, and predicted vs realized KL.

    torchrun --nproc-per-node 2 benchmarks/bench_kl_control.py
    torchrun --nproc-per-node 8 benchmarks/bench_kl_control.py --device cuda

1. Overhead, probing every step: median controller time (``time/kl_control_s``) over a
   training step without control on the same batch, for probe fractions 1/16, 1/8, 1/4,
   with the controller's own reference forward (library API) and with the reference kept
   from the training forward (pretrain_rl.py); plus all steps scaled (one more trial) and
   ``kl/realized`` on (the held-out rows join each trial's forward).
2. Probe skipping: probe 1/8, probing every step against the default probe skipping,
   interleaved ``--repeats`` times (mean controller time per step, amortized).
3. Honesty: a training run (probe 1/8, the target cycled over 16x so most steps are scaled
   by different amounts): Pearson(``kl/predicted_committed``, ``kl/realized``) and the mean
   ratio over the probed steps; then a run far below target (most steps skip the probe):
   the skipped steps' extrapolated KL against their realized KL.

The policy is a bf16 Megatron GPT (RMSNorm, SwiGLU, RoPE) trained with LoGRA on a fixed
random-token batch; DP = world size. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per DP rank and step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    ap.add_argument("--run-steps", type=int, default=20, help="steps of the honesty run")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--repeats", type=int, default=3, help="of the probe-skipping comparison")
    ap.add_argument(
        "--skipping-only",
        action="store_true",
        help="leave out the probe-fraction table (probing every step)",
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda (NCCL) when a GPU is visible, else cpu (gloo)",
    )
    return ap.parse_args()


def _sync(device: torch.device) -> None:
    """Wait for the GPU, so that host timers measure its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args):
    from megatron.core.optimizer import OptimizerConfig

    from loggra_megatron.optim import LoGRAConfig, get_loggra_optimizer
    from loggra_megatron.testing import tiny_gpt_model, wrap_ddp

    torch.manual_seed(0)
    model = tiny_gpt_model(
        num_layers=args.layers,
        hidden_size=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        bf16=True,
    )
    ddp = wrap_ddp(model)
    config = OptimizerConfig(
        optimizer="adam", lr=args.lr, bf16=True, use_distributed_optimizer=True, clip_grad=1.0
    )
    return ddp, get_loggra_optimizer(
        config, [ddp], LoGRAConfig(loggra_sketch="gradient")
    )  # rank: hidden / 8


def backward(ddp, opt, tokens, mask, update=None):
    """Forward + backward of the batch as pretrain_rl.py's actor runs it (one micro-batch,
    next-token NLL); ``update``: KL control's, whose probe reference this forward keeps."""
    from megatron.core import parallel_state as ps

    from loggra_megatron.rl.actor import forward_backward, global_counts, sft_loss_fn

    num_tokens, _ = global_counts(mask, len(tokens), ps.get_data_parallel_group())
    loss_fn = sft_loss_fn(num_tokens)
    if update is not None:
        loss_fn = update.keep_reference(loss_fn)
    dp = ps.get_data_parallel_world_size()
    forward_backward(ddp, opt, [{"tokens": tokens, "mask": mask}], loss_fn, dp)


def controller(ddp, opt, **cfg):
    from loggra_megatron.optim.megatron.stepper import MegatronStepper
    from loggra_megatron.rl.config import KLControlConfig
    from loggra_megatron.rl.kl_control import PredictedKLController
    from loggra_megatron.rl.kl_probe import gpt_probe_forward
    from loggra_megatron.train.build import probe_kl

    config = KLControlConfig(**cfg)
    device = next(ddp.parameters()).device
    measure = probe_kl(gpt_probe_forward(ddp), config.kl_estimator, device=device)
    return PredictedKLController(config, MegatronStepper(opt), measure)


@dataclass
class Bench:
    """The settings, the device and the fixed batch every measurement runs on."""

    args: argparse.Namespace
    device: torch.device
    tokens: torch.Tensor  # [batch, seq + 1], the same ids on every device
    mask: torch.Tensor  # [batch, seq], all true


def setup(args) -> Bench:
    """Megatron and the fixed batch (the same ids on every device)."""
    from megatron.core import parallel_state

    from loggra_megatron.parallel import initialize_megatron

    # CPU mode + gloo on CPU, NCCL on GPU; the model is built on the returned device
    device = initialize_megatron(device=args.device)
    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(100 + dp_rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    tokens = tokens.to(device)  # the same ids on every device
    mask = torch.ones(args.batch, args.seq, dtype=torch.bool, device=device)
    return Bench(args, device, tokens, mask)


def measure_baseline(bench: Bench, ddp, opt) -> float:
    """Median time of a training step without control (forward + backward + optimizer)."""
    base = []
    for i in range(bench.args.steps + 1):
        _sync(bench.device)
        t0 = time.perf_counter()
        backward(ddp, opt, bench.tokens, bench.mask)
        opt.step()
        _sync(bench.device)
        if i:
            base.append(time.perf_counter() - t0)
    return statistics.median(base)


def controller_share(
    bench: Bench,
    ddp,
    opt,
    t_base: float,
    frac: float,
    kept: bool,
    target: float | None = 1e9,
    realized: bool = False,
    skip: bool = False,
    stat=statistics.median,
) -> float:
    """Median controller time / baseline step. ``kept``: the probe reference comes from
    the training forward, as in pretrain_rl.py (computed here outside the timer), else
    the controller runs its own reference forward. ``target`` 1e9: never scaled; None: a
    quarter of the first step's KL, so that every step is scaled (η ≈ 1/2).
    ``realized``: ``kl/realized`` on the held-out rows every step
    (``--kl-realized-interval 1``). ``skip``: probe skipping on (the default,
    ``--kl-probe-skip-below 0.1``), else the probe runs every step. ``stat`` over the steps'
    controller times (the mean amortizes the probes of a skipping controller)."""
    ctl = controller(
        ddp,
        opt,
        kl_target=target or 1e9,
        kl_probe_fraction=frac,
        kl_realized_interval=int(realized),
        kl_probe_skip_below=0.1 if skip else 0.0,
    )
    args, tokens, mask = bench.args, bench.tokens, bench.mask
    times = []
    for i in range(args.steps + (target is None)):
        update = ctl.begin(tokens, mask)
        backward(ddp, opt, tokens, mask, update if kept else None)
        _sync(bench.device)
        m = ctl.step(update).metrics()
        if target is None and i == 0:  # aim at a quarter of the raw step's KL
            ctl.config.kl_target = m["kl/predicted"] / 4
            continue
        times.append(m["time/kl_control_s"])
    return stat(times) / t_base


def measure_overhead(bench: Bench, ddp, opt, t_base: float):
    """Controller shares per probe fraction (own / kept reference), then the scaled and the
    realized-KL settings at probe 1/8."""

    def share(frac: float, **kw) -> float:
        return controller_share(bench, ddp, opt, t_base, frac, **kw)

    overhead = {
        frac: (share(frac, kept=False), share(frac, kept=True)) for frac in (1 / 16, 1 / 8, 1 / 4)
    }
    scaled = share(1 / 8, kept=True, target=None)  # η < 1: one more trial
    checked = share(1 / 8, kept=True, realized=True)  # held-out rows in the trial
    return overhead, scaled, checked


def measure_skipping(bench: Bench, ddp, opt, t_base: float) -> dict[str, list[tuple]]:
    """Probe 1/8, reference from the training forward, never scaled: the mean controller
    share over ``--steps`` steps probing every step and with probe skipping, interleaved
    (the order alternates) ``--repeats`` times; per setting (``kl/realized`` every step or
    off) the ``(probing, skipping)`` pair of each repeat."""
    pairs = {"kl/realized every step": [], "kl/realized off": []}
    for i in range(bench.args.repeats):
        for name, realized in (("kl/realized every step", True), ("kl/realized off", False)):
            order = (False, True) if i % 2 == 0 else (True, False)
            share = {
                skip: controller_share(
                    bench,
                    ddp,
                    opt,
                    t_base,
                    1 / 8,
                    kept=True,
                    realized=realized,
                    skip=skip,
                    stat=statistics.mean,
                )
                for skip in order
            }
            pairs[name].append((share[False], share[True]))
    return pairs


def measure_honesty(args, tokens):
    """A fresh model trained with the controller on, the target cycled over 16x: the KL
    predicted for each committed step, the KL realized, and the step scales."""
    ddp, opt = build(args)
    # probe skipping on, kl/realized on every update
    ctl = controller(ddp, opt, kl_target=1e9, kl_probe_fraction=1 / 8, kl_realized_interval=1)
    mask = torch.ones_like(tokens[:, 1:], dtype=torch.bool)
    predicted, realized, scales, skipped = [], [], [], 0
    base_target = None
    for step in range(args.run_steps):
        backward(ddp, opt, tokens, mask)
        if base_target is not None:  # cycle the target over 16x so predictions span a range
            ctl.config.kl_target = base_target * 4.0 ** (step % 3 - 1)
        m = ctl.step(ctl.begin(tokens)).metrics()
        if step == 0:  # aim the middle target at a quarter of the first step's KL
            base_target = m["kl/predicted"] / 4
        elif m["kl/probe_skipped"]:  # its kl/predicted is an extrapolation: not compared
            skipped += 1
        else:
            predicted.append(m["kl/predicted_committed"])
            realized.append(m["kl/realized"])
            scales.append(m["kl/step_scale"])
    return predicted, realized, scales, skipped


def measure_skip_honesty(args, tokens, factor: float = 20.0):
    """A fresh model trained with probe skipping at a target ``factor`` × the first step's
    KL (far below it: most steps skip): on the skipped steps, the extrapolated KL (their
    ``kl/predicted``) against the full step's KL measured on the held-out rows."""
    ddp, opt = build(args)
    ctl = controller(ddp, opt, kl_target=1e9, kl_probe_fraction=1 / 8, kl_realized_interval=1)
    mask = torch.ones_like(tokens[:, 1:], dtype=torch.bool)
    pairs = []
    for step in range(args.run_steps):
        backward(ddp, opt, tokens, mask)
        m = ctl.step(ctl.begin(tokens)).metrics()
        if step == 0:
            ctl.config.kl_target = factor * m["kl/predicted"]
        elif m["kl/probe_skipped"]:
            pairs.append((m["kl/predicted"], m["kl/realized"]))
    return pairs, ctl.config.kl_target


def report_overhead(args, device, t_base, overhead, scaled, checked):
    """The per-fraction overhead table (probing every step; rank 0)."""
    print(
        f"# bench_kl_control: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
        f"seq {args.seq}, {args.batch} seqs/rank, DP={dist.get_world_size()}, bf16, LoGRA, "
        f"{device.type}"
    )
    print(f"\nbaseline step (fwd+bwd+opt): {1e3 * t_base:.0f} ms")
    if overhead is None:
        return
    print(
        "\nProbing every step (--kl-probe-skip-below 0), median over steps:\n"
        "\n| probe fraction | own reference forward | reference from the training "
        "forward (pretrain_rl.py) | target |"
    )
    print("|---|---:|---:|---|")
    for frac, (own, kept) in overhead.items():
        print(f"| 1/{round(1 / frac)} | {100 * own:.1f} % | {100 * kept:.1f} % | < 10 % at 1/8 |")
    print(f"| 1/8, every step scaled (η ≈ 1/2: one more trial) | | {100 * scaled:.1f} % | |")
    print(
        f"| 1/8, kl/realized every step (held-out rows join the trial's forward) | | "
        f"{100 * checked:.1f} % | |"
    )


def report_skipping(args, pairs):
    """Probing every step against probe skipping, per repeat and their medians."""
    print(
        f"\nProbe 1/8, reference from the training forward, never scaled: mean controller "
        f"time over {args.steps} steps / baseline step, {args.repeats} interleaved repeats\n"
        "\n| setting | probing every step | probe skipping (default) | skipping / probing |"
    )
    print("|---|---:|---:|---:|")
    for name, rows in pairs.items():
        probing = statistics.median(p for p, _ in rows)
        skipping = statistics.median(s for _, s in rows)
        ratios = [s / p for p, s in rows]
        print(
            f"| {name} | {100 * probing:.1f} % | {100 * skipping:.1f} % | "
            f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)}) |"
        )


def report_honesty(predicted, realized, scales, skipped, skip_pairs, skip_target):
    """Pearson(predicted, realized) on the probed steps; the skipped steps' extrapolation."""
    p, r = torch.tensor(predicted), torch.tensor(realized)
    corr = torch.corrcoef(torch.stack([p, r]))[0, 1].item()
    ratio = (r / p).mean().item()
    print(
        f"\npredicted vs realized over {len(p)} probed steps (probe 1/8, held-out 1/8; "
        f"{skipped} skipped): Pearson r = {corr:.3f}, mean realized/predicted = {ratio:.2f}, "
        f"step scale min/median = {min(scales):.2f}/{statistics.median(scales):.2f}"
    )
    if skip_pairs:
        bound = torch.tensor([b for b, _ in skip_pairs])
        real = torch.tensor([x for _, x in skip_pairs])
        print(
            f"skipped steps at target {skip_target:.2e} (20x the first step's KL): "
            f"{len(skip_pairs)}; realized / extrapolated mean {(real / bound).mean():.2f}, "
            f"max {(real / bound).max():.2f}; max realized / target "
            f"{(real.max() / skip_target).item():.3f}"
        )


def main() -> None:
    args = parse_args()
    bench = setup(args)
    ddp, opt = build(args)
    t_base = measure_baseline(bench, ddp, opt)
    overhead = scaled = checked = None
    if not args.skipping_only:
        overhead, scaled, checked = measure_overhead(bench, ddp, opt, t_base)
    pairs = measure_skipping(bench, ddp, opt, t_base)
    honesty = measure_honesty(args, bench.tokens)
    skip_honesty = measure_skip_honesty(args, bench.tokens)
    if dist.get_rank() == 0:
        report_overhead(args, bench.device, t_base, overhead, scaled, checked)
        report_skipping(args, pairs)
        report_honesty(*honesty, *skip_honesty)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
