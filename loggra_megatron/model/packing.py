"""Packed sequences (THD): a micro-batch's rows laid end to end in one row, no padding between.

A micro-batch ``tokens [b, s + 1]`` whose row ``i`` needs ``l_i`` fed positions
(``LENGTHS``) is fed as one row of ``T = Σ l_i``
tokens, rounded up to the model's ``sequence_multiple``
(the extra slots extend the last row: causal attention keeps them out of its real
positions). Megatron-Core's ``PackedSeqParams(qkv_format="thd")`` tells attention where the
rows start (``cu_seqlens``, int32 ``[b + 1]`` on the tokens' device, as Transformer Engine
asserts) and how long the longest is; RoPE restarts at each row (Megatron applies it per
``cu_seqlens``), so row ``i``'s logits are those it has alone. ``PackedRows.unpack``
puts the ``[1, T, V/TP]`` logits back in the micro-batch's ``[b, s, V/TP]`` layout (zeros
past each row's ``l_i``), so every loss and log-prob consumer is unchanged. The transformer
layers run ``T`` tokens instead of ``b × s``. Only Transformer Engine's attention takes THD
(Megatron's local ``DotProductAttention`` refuses ``packed_seq_params``), flash or cuDNN
fused kernels, fp16/bf16 only. Megatron-LM's counterpart: ``--rl-use-sequence-packing``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACKED = "packed"
"""Key of a micro-batch packed by ``pack_micro_batch``: its ``PackedRows``."""


@dataclass
class PackedRows:
    """Where the rows of a ``[b, s]`` micro-batch lie in its packed row of ``T`` slots."""

    input_ids: torch.Tensor
    """``[1, T]`` the fed tokens, row after row (0 in the padding slots at the end)."""
    position_ids: torch.Tensor
    """``[1, T]`` each slot's position within its row."""
    cu_seqlens: torch.Tensor
    """``[b + 1]`` int32: row ``i`` occupies slots ``cu_seqlens[i] .. cu_seqlens[i + 1]``."""
    max_seqlen: int
    """The longest row (with the padding that extends the last)."""
    rows: torch.Tensor
    """``[n]`` the row of each of the first ``n = Σ l_i`` (real) slots."""
    positions: torch.Tensor
    """``[n]`` the position of each real slot within its row."""
    shape: tuple[int, int]
    """``(b, s)``: the micro-batch's layout, which ``unpack`` restores."""

    @property
    def num_slots(self) -> int:
        """``T``: the slots fed, padding included."""
        return self.input_ids.shape[1]

    @property
    def num_real(self) -> int:
        """``Σ l_i``: the real slots."""
        return self.rows.numel()

    def packed_seq_params(self):
        """Megatron-Core's ``PackedSeqParams`` for these rows (THD, self-attention)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed [1, T, ...]`` (e.g. logits) as ``[b, s, ...]`` in the micro-batch's row
        layout, zeros past each row's length (differentiable)."""
        values = packed[0, : self.num_real]
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        return out.index_put((self.rows, self.positions), values)


def pack_micro_batch(batch: dict, lengths: torch.Tensor, multiple: int, width: int = 0) -> dict:
    """``batch`` (``tokens [b, s + 1]``, row ``i`` needing ``lengths[i]`` fed positions, in
    ``1 .. s``) with its ``PackedRows`` under ``PACKED``: ``T = Σ lengths`` slots,
    at least ``width`` (PP: the longest of the schedule call), rounded up to ``multiple``."""
    tokens = batch["tokens"]
    b, s = tokens.shape[0], tokens.shape[1] - 1
    n = int(lengths.sum())
    total = max(n, width)
    total += -total % multiple
    starts = torch.cumsum(lengths, 0) - lengths
    rows = torch.repeat_interleave(torch.arange(b, device=tokens.device), lengths)
    positions = torch.arange(n, device=tokens.device) - starts[rows]
    input_ids = tokens.new_zeros(1, total)
    input_ids[0, :n] = tokens[rows, positions]
    position_ids = torch.arange(total, device=tokens.device).unsqueeze(0) - starts[-1]
    position_ids[0, :n] = positions  # the padding slots continue the last row
    cu_seqlens = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)
    packed = PackedRows(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(cu_seqlens.diff().max()),
        rows=rows,
        positions=positions,
        shape=(b, s),
    )
    return {**batch, PACKED: packed}
