"""The optimizer state of real optimizers after one step, for the memory model's tests:
``LoGRAAdamW`` (embeddings and output layer dense) and ``torch.optim.AdamW``."""

from __future__ import annotations

import warnings

import torch

from loggra_megatron.optim import LoGRAAdamW, state_bytes

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4)
SMALL.update(num_query_groups=2, vocab_size=200)
"""hidden 64, 4 heads / 2 groups of 16, ffn 96, vocab 200 (padded to 256 at TP=2)."""
RANK, MIN_DIM = 56, 40
"""At TP=2: linear_proj [64, 32] dense; linear_fc2 [64, 48] clamped to 48."""


def step_optimizers(named_params: list[tuple[str, torch.nn.Parameter]]) -> dict[str, int]:
    """state_bytes of LoGRAAdamW (embeddings/output layer dense) and AdamW after one step."""
    out = {}
    for kind in ("loggra", "adam"):
        params = [torch.nn.Parameter(p.detach().float().clone()) for _, p in named_params]
        for p in params:
            p.grad = torch.randn_like(p)
        if kind == "adam":
            opt = torch.optim.AdamW(params, lr=1e-3)
        else:
            dense = [
                p
                for (n, _), p in zip(named_params, params, strict=True)
                if "embedding" in n or "output_layer" in n
            ]
            rest = [p for p in params if all(p is not q for q in dense)]
            groups = [{"params": dense, "sketch": False}, {"params": rest}]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the intended rank clamp of linear_fc2
                opt = LoGRAAdamW(groups, lr=1e-3, rank=RANK, min_dim=MIN_DIM)
        opt.step()
        out[kind] = state_bytes(opt)
    return out
