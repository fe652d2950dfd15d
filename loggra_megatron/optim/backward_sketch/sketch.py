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
communication; it is redrawn every ``refresh_interval`` updates and never saved or sent.
Drawing ``±1`` (exact in bf16) and applying ``1/√r`` in fp32 keeps the forward's ``P`` and the
update's ``A`` the same matrix in any dtype. A Rademacher ``B`` packs into one bit per entry
(``pack_signs``: ``[r, ⌈n/8⌉]`` uint8; ``unpack_signs`` gives back exactly ``±1`` in any dtype),
which is how the Megatron adapter keeps an update's draws between their uses.

``fp32_matmul`` forms ``Hᵀ P`` (16-bit operands, fp32 result) by the best path the operands
and the device allow, each logged once (``MATMUL_PATHS``).

Sharding (where the sums happen) is the Megatron adapter's: ``optim/megatron/backward_sites.py``.
Reference: Zhang et al., "Scaling LLM reinforcement learning with low-rank gradient sketches",
arXiv:2610.06647 (2026); Johnson & Lindenstrauss (1984); Achlioptas, "Database-friendly random
projections" (2003) for the Rademacher form.
"""

from __future__ import annotations

import hashlib
import logging
import math

import torch

SKETCH_MATRICES = ("rademacher", "gaussian")
"""``--loggra-sketch-matrix`` choices."""

ROW_GATHER_BUCKET_NUMEL = 40_000_000
"""Elements a bucket of the targets' DP weight sync gathers at most (Megatron-LM's default
DDP bucket size; a larger target is a bucket of its own): bounds its staging buffer
(``optim/megatron/backward_row_gather.py``)."""

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


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """``[r, n]`` of ±1 → ``[r, ⌈n/8⌉]`` uint8, bit ``j`` of byte ``c`` set where entry
    ``8c + j`` is +1 (zero padding past ``n``)."""
    rows, cols = signs.shape
    bits = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.uint8, device=signs.device)
    bits[:, :cols] = signs > 0
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=signs.device)
    return (bits.view(rows, -1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, cols: int, dtype) -> torch.Tensor:
    """``pack_signs``' inverse: ``[r, cols]`` of exactly ±1 in ``dtype`` (a new tensor; the
    transient is one byte per entry)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.view(packed.shape[0], -1)[:, :cols].to(dtype).mul_(2).sub_(1)


MATMUL_PATHS = {
    "fp32": "fp32 operands, one fp32 GEMM",
    "mm_out_dtype": "16-bit operands, one GEMM accumulating and writing fp32 "
    "(torch.mm(..., out_dtype=torch.float32))",
    "gemm_fp32_accumulate": "16-bit GEMM accumulating in fp32 (reduced-precision reductions "
    "off), its 16-bit result converted to fp32",
    "fp32_copy": "16-bit operands converted to fp32, one fp32 GEMM",
}
"""``fp32_matmul``'s paths: ``fp32`` for fp32 operands; for 16-bit CUDA operands
``mm_out_dtype`` where this torch has it, else ``gemm_fp32_accumulate`` (its result rounded
once to 16 bits: a relative error of at most ``2⁻⁹`` per entry for bf16, the size of the
operands' own rounding); ``fp32_copy`` elsewhere (CPU), exact up to fp32 sums."""

_paths_run: set[str] = set()
_no_out_dtype: set[tuple[str, torch.dtype]] = set()
"""``(device type, dtype)`` whose ``torch.mm`` has refused ``out_dtype``."""
_log = logging.getLogger(__name__)


def matmul_paths_run() -> frozenset[str]:
    """The ``MATMUL_PATHS`` that ``fp32_matmul`` has run in this process."""
    return frozenset(_paths_run)


def _ran(path: str, result: torch.Tensor) -> torch.Tensor:
    if path not in _paths_run:
        _paths_run.add(path)
        _log.info("fp32_matmul (the backward sketch's H^T P) runs %s: %s", path, MATMUL_PATHS[path])
    return result


def fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 result, by the first ``MATMUL_PATHS`` entry the operands and the
    device allow (module docstring)."""
    if a.dtype == b.dtype == torch.float32:
        return _ran("fp32", a @ b)
    half = a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
    if not (half and a.is_cuda):
        return _ran("fp32_copy", a.float() @ b.float())
    if (a.device.type, a.dtype) not in _no_out_dtype:
        try:
            return _ran("mm_out_dtype", torch.mm(a, b, out_dtype=torch.float32))
        except torch.cuda.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError) as error:  # an older torch: no such overload
            _no_out_dtype.add((a.device.type, a.dtype))
            _log.info("torch.mm(..., out_dtype=torch.float32) is unavailable: %s", error)
    return _ran("gemm_fp32_accumulate", fp32_accumulated_matmul(a, b))


def fp32_accumulated_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a @ b).float()`` for 16-bit ``a``, ``b`` with CUDA's reduced-precision reductions of
    that dtype switched off for the call (cuBLAS then sums in fp32 throughout)."""
    flags = torch.backends.cuda.matmul
    name = f"allow_{'bf16' if a.dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction"
    before = getattr(flags, name)
    setattr(flags, name, False)
    try:
        return (a @ b).float()
    finally:
        setattr(flags, name, before)


def gram_sq_norm(rows: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``‖rows · A‖²_F = ⟨rows (A Aᵀ), rows⟩`` for ``A = signs/√r`` (``rows``: ``[k, r]``
    fp32), without forming ``[k, n]``: fp32 scalar."""
    b = signs.float()
    gram = (b @ b.t()).mul_(1.0 / b.shape[0])  # A Aᵀ   [r, r]
    return ((rows @ gram) * rows).sum()


def reconstruct(rows: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``rows · A`` (``[k, r] → [k, n]``, fp32): the update direction in weight space."""
    return (rows @ signs.float()).mul_(sketch_scale(signs.shape[0]))
