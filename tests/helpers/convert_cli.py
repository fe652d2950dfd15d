"""tools/convert_checkpoint.py for the tests: its main() imported by path, and the tensors of
a Hugging Face safetensors directory."""

import importlib.util
import os
from pathlib import Path

from safetensors.torch import load_file

ROOT = str(Path(__file__).resolve().parents[2])
CLI = os.path.join(ROOT, "tools", "convert_checkpoint.py")


def cli_main(argv) -> int:
    """tools/convert_checkpoint.py's main(), imported by path."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", CLI)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def export_hf(run, out, *flags) -> dict:
    """``convert_checkpoint.py --direction megatron-to-hf --load run --save out flags``, forked
    warm (``warm_launch``); the tensors it wrote (``load_hf_dir``)."""
    import warm_launch

    argv = ["--direction", "megatron-to-hf", "--load", run, "--save", out, *flags]
    done = warm_launch.run(CLI, [str(a) for a in argv])
    assert done.returncode == 0, done.stderr[-3000:]
    return load_hf_dir(out)


def load_hf_dir(path) -> dict:
    """``{name: tensor}`` of every ``*.safetensors`` file in ``path``."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out
