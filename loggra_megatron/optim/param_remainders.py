"""fp32 master weights stored as the bf16 model weight plus a 16-bit remainder (exact).

An fp32 number's bits are ``u = H·2¹⁶ + L`` (sign, exponent and 7 mantissa bits in ``H``,
the low 16 mantissa bits in ``L``); bf16 is the upper half. Instead of a separate fp32
master copy (4 bytes per parameter), the optimizer keeps

    B = H + [L ≥ 2¹⁵]          the bf16 model weight itself (round half up in magnitude)
    d = L − 2¹⁶·[L ≥ 2¹⁵]      an int16 remainder, d ∈ [−2¹⁵, 2¹⁵)

and recovers the master exactly as ``u = B·2¹⁶ + d`` (two's-complement int32 arithmetic).
Megatron-Core does the same for its precision-aware optimizer (``store_param_remainders``,
inside Transformer Engine's FusedAdam, GPU only); this module is the torch version that the
LoGRA optimizer uses on any device, one weight at a time.

A copy of the master on another device (a checkpoint's, on the host) is rebuilt
``COPY_BUCKET_NUMEL`` elements at a time (``join_master_into``): the weight's device
then holds one bucket's int32 bits beyond the live state, ``copy_transient_bytes``.

Rounding, negative numbers, memory and exactness:
docs/optimizer.md#fp32-master-weights-as-bf16-weights--int16-remainders---loggra-param-remainders
"""

from __future__ import annotations

import torch

_HALF = 1 << 15

COPY_BUCKET_NUMEL = 1 << 24
"""Elements of a master rebuilt at once by ``join_master_into`` (16 Mi: 64 MiB of int32
bits on the weight's device)."""


def copy_transient_bytes(bucket_numel: int = COPY_BUCKET_NUMEL) -> int:
    """Bytes ``join_master_into`` allocates at once on the weight's device: one bucket's
    int32 bits, ``4 · bucket_numel`` (the bucket's bf16 and int16 slices are views)."""
    return 4 * bucket_numel


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master (a new tensor) of a bf16 ``weight`` and its int16 ``remainder``:
    ``B·2¹⁶ + d`` in int32, one temporary of the master's size."""
    if weight.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(
            f"join_master needs bf16 weights and int16 remainders, got {weight.dtype} and "
            f"{remainder.dtype}"
        )
    bits = weight.contiguous().view(torch.int16).to(torch.int32)  # sign-extended B
    return bits.mul_(1 << 16).add_(remainder).view(torch.float32)


def join_master_into(
    weight: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor, bucket_numel: int
) -> torch.Tensor:
    """Write the fp32 master of contiguous ``weight`` and ``remainder`` into fp32 ``out`` (as
    many elements, any device, e.g. the host) and return ``out``: ``join_master`` of
    ``bucket_numel`` elements at a time on the weight's device, each copied into ``out``
    before the next is rebuilt."""
    if out.dtype != torch.float32:
        raise TypeError(f"join_master_into writes an fp32 master, not {out.dtype}")
    flat_weight, flat_remainder, flat_out = weight.view(-1), remainder.view(-1), out.view(-1)
    for lo in range(0, flat_weight.numel(), bucket_numel):
        hi = lo + bucket_numel
        flat_out[lo:hi].copy_(join_master(flat_weight[lo:hi], flat_remainder[lo:hi]))
    return out


def store_master(weight: torch.Tensor, remainder: torch.Tensor, master: torch.Tensor) -> None:
    """Write fp32 ``master`` into ``weight`` (bf16, in place, may be a view of the model's
    parameter buffer) and ``remainder`` (int16, in place). ``master`` is **consumed** (its
    storage is reused, so no temporary is allocated): pass a tensor the caller owns.

    ``d`` is the low half of the bits read as int16 (``L`` when ``L < 2¹⁵``, else
    ``L − 2¹⁶``: the int32 → int16 conversion wraps), and ``B`` is
    ``_rounded_high_half``."""
    if master.dtype != torch.float32 or not master.is_contiguous():
        raise TypeError("store_master needs a contiguous fp32 master")
    bits = master.view(torch.int32).view(weight.shape)
    remainder.copy_(bits)  # wraps to the low 16 bits
    weight.view(torch.int16).copy_(_rounded_high_half(bits))


def weight_of(master: torch.Tensor) -> torch.Tensor:
    """The bf16 weight ``store_master`` writes for fp32 ``master`` (round to nearest,
    ties away from zero), as a new tensor; ``master`` is **consumed**."""
    if master.dtype != torch.float32 or not master.is_contiguous():
        raise TypeError("weight_of needs a contiguous fp32 master")
    return _rounded_high_half(master.view(torch.int32)).to(torch.int16).view(torch.bfloat16)


def _rounded_high_half(bits: torch.Tensor) -> torch.Tensor:
    """``B = (u + 2¹⁵) >> 16`` of int32 bits ``u``, in place (arithmetic shift; the carry is
    the rounding)."""
    return bits.add_(_HALF).bitwise_right_shift_(16)
