"""LoGRA as published: gradient sketches formed in the backward pass (torch only).

For a target linear layer ``y = x Wᵀ`` (``W ∈ R^{m×n}``) the dense weight gradient
``G = Hᵀ X`` (``H = ∂L/∂y``: ``[tokens, m]``, ``X``: ``[tokens, n]``) is never formed.
Instead, with a random projection ``A = B/√r`` (``B ∈ R^{r×n}``, Rademacher ``±1`` or
Gaussian ``N(0, 1)``, so ``E[AᵀA] = I``: a Johnson–Lindenstrauss map):

    forward:   P = X Bᵀ                       [tokens, r]   (activation dtype, kept for backward)
    backward:  S += Hᵀ P / √r                 [m, r]        (fp32, summed over micro-batches)
               S = G Aᵀ exactly                (linearity)
    clip norm: ‖S A‖² = ⟨S (A Aᵀ), S⟩          an r×r Gram per layer, no [m, n] tensor
    update:    W ← (1 − lr·λ) W − lr · D A     D = RowAdam(S) (``row_adam``)

``B`` is drawn from ``(seed, draw index, name)`` with a counter-based seed
(``projection_seed``), so every TP, DP and PP rank draws the same matrix without
communication; it is redrawn every ``refresh_interval`` updates and never stored. Drawing
``±1`` (exact in bf16) and applying ``1/√r`` in fp32 keeps the forward's ``P`` and the update's
``A`` the same matrix in any dtype.

Sharding (where the sums happen) is the Megatron adapter's: ``optim/megatron/sketch_sites.py``.
Reference: Zhang et al., "Scaling LLM reinforcement learning with low-rank gradient sketches",
arXiv:2610.06647 (2026); Johnson & Lindenstrauss (1984); Achlioptas, "Database-friendly random
projections" (2003) for the Rademacher form.
"""

from __future__ import annotations

import hashlib
import math

import torch

SKETCH_MATRICES = ("rademacher", "gaussian")
"""``--loggra-sketch-matrix`` choices."""

SKETCH_REDUCTIONS = ("step", "microbatch")
"""``--loggra-sketch-reduce`` choices: when ``S`` is summed over data parallelism."""


def projection_seed(seed: int, draw: int, name: str) -> int:
    """A 63-bit seed for ``(base seed, draw index, weight name)``: the same on every rank."""
    digest = hashlib.blake2b(f"{seed}:{draw}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw_signs(
    kind: str, seed: int, draw: int, name: str, rank: int, cols: int, device, dtype
) -> torch.Tensor:
    """``B``: ``[rank, cols]`` of ±1 (``rademacher``) or ``N(0, 1)`` rounded to ``dtype``
    (``gaussian``), drawn on ``device`` from ``projection_seed``. The projection is
    ``A = B / √rank``."""
    if kind not in SKETCH_MATRICES:
        raise ValueError(f"unknown sketch matrix {kind!r}; one of {', '.join(SKETCH_MATRICES)}")
    generator = torch.Generator(device=device)
    generator.manual_seed(projection_seed(seed, draw, name))
    if kind == "gaussian":
        b = torch.randn(rank, cols, generator=generator, device=device, dtype=torch.float32)
        return b.to(dtype)
    b = torch.empty(rank, cols, device=device, dtype=torch.float32)
    return b.bernoulli_(0.5, generator=generator).mul_(2).sub_(1).to(dtype)


def sketch_scale(rank: int) -> float:
    """``1/√r``: the factor between the drawn ``B`` and the projection ``A``."""
    return 1.0 / math.sqrt(rank)


def fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 result: 16-bit operands go through one GEMM with fp32 output
    where torch offers it on the device (CUDA), else are converted first."""
    if a.dtype == b.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return a.float() @ b.float()


def gram_sq_norm(rows: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``‖rows · A‖²_F = ⟨rows (A Aᵀ), rows⟩`` for ``A = signs/√r`` (``rows``: ``[k, r]``
    fp32), without forming ``[k, n]``: fp32 scalar."""
    b = signs.float()
    gram = (b @ b.t()).mul_(1.0 / b.shape[0])  # A Aᵀ   [r, r]
    return ((rows @ gram) * rows).sum()


def reconstruct(rows: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``rows · A`` (``[k, r] → [k, n]``, fp32): the update direction in weight space."""
    return (rows @ signs.float()).mul_(sketch_scale(signs.shape[0]))
