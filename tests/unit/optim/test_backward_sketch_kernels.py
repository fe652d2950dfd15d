"""The backward sketch's 1-bit projections and its fp32-result GEMM
(``optim/backward_sketch/sketch.py``): packing is exact in every dtype; each ``fp32_matmul`` path is
logged once and agrees with float64 within its precision."""

import logging

import pytest
import torch

from loggra_megatron.optim.backward_sketch import sketch as bs


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 37])
def test_packed_signs_unpack_to_the_draw_exactly(cols):
    signs = bs.draw_signs("rademacher", 3, 1, "layer2.linear_fc2", 5, cols, "cpu", torch.float32)
    packed = bs.pack_signs(signs)
    assert packed.dtype == torch.uint8 and packed.shape == (5, -(-cols // 8))
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        unpacked = bs.unpack_signs(packed, cols, dtype)
        assert unpacked.dtype == dtype and torch.equal(unpacked.double(), signs.double())
    # a column block (a row-parallel TP rank's) packs and unpacks alike
    block = signs[:, cols // 2 :]
    assert torch.equal(bs.unpack_signs(bs.pack_signs(block), block.shape[1], torch.float32), block)


def _operands(dtype, m=96, tokens=300, r=16):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, m, generator=g).to(dtype)
    p = torch.randn(tokens, r, generator=g).to(dtype)
    return h.t(), p, h.double().t() @ p.double()


def test_fp32_matmul_on_cpu_converts_16_bit_operands_and_logs_the_path_once(caplog, monkeypatch):
    monkeypatch.setattr(bs, "_paths_run", set())
    a, b, exact = _operands(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=bs.__name__):
        first = bs.fp32_matmul(a, b)
        again = bs.fp32_matmul(a, b)
    assert first.dtype == torch.float32 and torch.equal(first, again)
    assert bs.matmul_paths_run() == {"fp32_copy"}
    logged = [r.getMessage() for r in caplog.records if "fp32_copy" in r.getMessage()]
    assert len(logged) == 1 and bs.MATMUL_PATHS["fp32_copy"] in logged[0]
    # the operands are exact in fp32: only fp32 summation error remains
    assert float((first.double() - exact).abs().max() / exact.abs().max()) < 1e-6
    full = bs.fp32_matmul(a.float(), b.float())
    assert bs.matmul_paths_run() == {"fp32_copy", "fp32"} and torch.allclose(full, first)


def test_the_fp32_accumulated_16_bit_gemm_is_within_bf16_rounding():
    """The CUDA fallback's arithmetic (a 16-bit GEMM, its result rounded once), run here on
    CPU: within bf16's half ulp, 2⁻⁹ relative, of the float64 product; the CUDA flag it
    switches off is restored."""
    flags = torch.backends.cuda.matmul
    before = flags.allow_bf16_reduced_precision_reduction
    a, b, exact = _operands(torch.bfloat16)
    got = bs.fp32_accumulated_matmul(a, b)
    assert got.dtype == torch.float32
    assert flags.allow_bf16_reduced_precision_reduction == before
    error = (got.double() - exact).abs() / exact.abs().clamp_min(exact.abs().max() * 1e-2)
    assert float(error.max()) < 2**-8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_matmul_on_cuda_accumulates_16_bit_operands_in_fp32(dtype, monkeypatch):
    monkeypatch.setattr(bs, "_paths_run", set())
    a, b, exact = (t.cuda() for t in _operands(dtype))
    got = bs.fp32_matmul(a, b)
    (path,) = bs.matmul_paths_run()
    assert got.dtype == torch.float32 and path in ("mm_out_dtype", "gemm_fp32_accumulate")
    tolerance = 1e-5 if path == "mm_out_dtype" else 2**-8
    scale = exact.abs().max()
    assert float((got.double() - exact).abs().max() / scale) < tolerance
