"""A GGUF file to a Megatron checkpoint: a tiny Llama GGUF (quantized, written here) through
tools/gguf_to_hf.py and tools/convert_checkpoint.py --direction hf-to-megatron; the Megatron
model's logits equal those transformers computes from the GGUF file."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from convert_cli import ROOT, cli_main  # noqa: E402
from test_convert_checkpoint import ATOL, IDS, _load_and_run  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

from loggra_megatron.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def _gguf_to_hf(argv) -> int:
    path = os.path.join(ROOT, "tools", "gguf_to_hf.py")
    spec = importlib.util.spec_from_file_location("gguf_to_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _convert_and_run(rank, hf_dir, mg_dir):
    assert cli_main(["--direction", "hf-to-megatron", "--load", hf_dir, "--save", mg_dir]) == 0
    return _load_and_run(mg_dir)[0]


def test_gguf_to_megatron_logits_match_transformers(tmp_path):
    gguf_file, hf, mg = tmp_path / "tiny.gguf", tmp_path / "hf", tmp_path / "mg"
    write_tiny_gguf(gguf_file)
    assert _gguf_to_hf(["--gguf", str(gguf_file), "--out", str(hf)]) == 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        expected = reference(IDS).logits
    (logits,) = run_distributed(_convert_and_run, 1, str(hf), str(mg))
    assert logits.shape == expected.shape  # the padded vocabulary cut to the tokenizer's
    diff = (logits.float() - expected).abs().max().item()
    assert diff <= ATOL, f"max |megatron - transformers(GGUF)| = {diff:.3e}"
