"""One prefill per GRPO group against a prefill of every row, on CPU, in one run.

    python benchmarks/rollout_prefill.py                       # 8 prompts × 8, prompts of 192
    python benchmarks/rollout_prefill.py --layers 20 --hidden 256 --json /tmp/prefill.json

A GRPO step samples ``--num-generations`` completions of each prompt, so the static engine's
batch holds every prompt G times. ``generate_rollout`` prefills each distinct prompt once
and copies its KV cache to the group's other rows (``docs/rollouts.md``, "One prefill per
prompt"); ``share_prefill=False`` prefills every row, as before. Both arms decode the same
seeded batch on the same weights, alternating, ``--repeats`` times each; printed: the
median seconds of the prefill forward and of the whole rollout, the prefill tokens, and
the decode loop's counts (forwards, host syncs per decode step, aten ops per decode forward
from ``torch.profiler``). Tokens must be equal in both arms (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    ap.add_argument("--num-generations", type=int, default=8, help="rows per prompt (G)")
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    return ap.parse_args(argv)


def _decode_ops(model, prompts, new_tokens: int) -> float:
    """aten ops per forward of the decode loop (profiled rollout, ops / forwards)."""
    from loggra_megatron.rollout import RolloutRequest, generate_rollout

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rollout = generate_rollout(
            model, prompts, RolloutRequest(max_new_tokens=new_tokens, seed=1)
        )
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    return ops / rollout.decode_steps


def _arm(model, prompts, args, share: bool) -> dict:
    from loggra_megatron.rollout import RolloutRequest, generate_rollout
    from loggra_megatron.rollout.static import generate as gen_module

    forward, prefill_s = gen_module._stage_forward, []

    def timed(*a, **kw):  # the rollout's first forward is its prefill
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        if not prefill_s:
            prefill_s.append(time.perf_counter() - t0)
        return out

    gen_module._stage_forward = timed
    try:
        t0 = time.perf_counter()
        rollout = generate_rollout(
            model,
            prompts,
            RolloutRequest(max_new_tokens=args.new_tokens, seed=1),
            share_prefill=share,
        )
        seconds = time.perf_counter() - t0
    finally:
        gen_module._stage_forward = forward
    return {
        "seconds": seconds,
        "prefill_s": prefill_s[0],
        "tokens": rollout.tokens,
        "prefill_tokens": rollout.prefill_tokens,
        "decode_steps": rollout.decode_steps,
        "host_syncs_per_step": rollout.host_syncs / rollout.decode_steps,
    }


def _main(rank: int, args) -> dict:
    from loggra_megatron.testing import tiny_gpt_model

    seq = args.prompt_tokens + args.new_tokens
    model = tiny_gpt_model(
        args.layers, args.hidden, args.heads, args.vocab, seq, ffn_hidden_size=4 * args.hidden
    )
    gen = torch.Generator().manual_seed(0)
    distinct = torch.randint(0, args.vocab, (args.prompts, args.prompt_tokens), generator=gen)
    prompts = distinct.repeat_interleave(args.num_generations, dim=0)  # GRPO groups
    runs: dict[str, list[dict]] = {"shared": [], "every row": []}
    _arm(model, prompts[:2], args, True)  # warm-up
    for _ in range(args.repeats):
        for name, share in (("every row", False), ("shared", True)):
            runs[name].append(_arm(model, prompts, args, share))
    same = all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(*runs.values(), strict=True))
    out = {
        "tokens_equal": same,
        "decode_ops_per_forward": _decode_ops(model, prompts, args.new_tokens),
    }
    for name, rs in runs.items():
        out[name] = {
            "prefill_s": statistics.median(r["prefill_s"] for r in rs),
            "rollout_s": statistics.median(r["seconds"] for r in rs),
            "prefill_tokens": rs[0]["prefill_tokens"],
            "decode_steps": rs[0]["decode_steps"],
            "host_syncs_per_step": rs[0]["host_syncs_per_step"],
        }
    return out


def main() -> None:
    from loggra_megatron.testing import run_distributed

    args = parse_args()
    rows = args.prompts * args.num_generations
    print(
        f"{rows} rows ({args.prompts} prompts × {args.num_generations}), prompts of "
        f"{args.prompt_tokens} tokens + {args.new_tokens} new, {args.layers} layers, hidden "
        f"{args.hidden}, fp32, CPU; medians of {args.repeats}"
    )
    out = run_distributed(_main, 1, args)[0]
    base, shared = out["every row"], out["shared"]
    print("\n| prefill | prefill tokens | prefill s | rollout s | forwards | host syncs / step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in (("every row", base), ("one per prompt", shared)):
        print(
            f"| {name} | {r['prefill_tokens']} | {r['prefill_s']:.3f} | {r['rollout_s']:.3f} | "
            f"{r['decode_steps']} | {r['host_syncs_per_step']:.3f} |"
        )
    print(
        f"\none per prompt / every row: prefill tokens {shared['prefill_tokens'] / base['prefill_tokens']:.3f}×, "
        f"prefill time {shared['prefill_s'] / base['prefill_s']:.3f}×, rollout time "
        f"{shared['rollout_s'] / base['rollout_s']:.3f}×; tokens equal: {out['tokens_equal']}; "
        f"aten ops per decode forward: {out['decode_ops_per_forward']:.0f}"
    )
    if not out["tokens_equal"]:
        raise SystemExit("the two arms sampled different tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)


if __name__ == "__main__":
    main()
