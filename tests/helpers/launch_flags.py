"""Reading GPU launch commands as the memory estimator's flags: the ``pretrain_rl.py`` line of
a launch script or of a document, its exported environment, and the numbers a text quotes
(shared by tests/integration/test_gpu_scripts.py and tests/unit/docs/test_memory_md.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
CONFIG_27B = os.path.join(ROOT, "tools", "configs", "llama-style-27b.json")
USABLE_GIB = 79.1  # of an "80 GB" H100 (docs/memory.md)

# pretrain_rl.py flags of the launch commands that change no term of the memory model, and why:
# the estimator reads them as pretrain_rl.py does (every flag of it is the estimator's too), and
# the documented estimator commands leave them out (tests/unit/tools/test_estimate_memory.py checks that the
# whole launch command prints the same).
MEMORY_NEUTRAL = {
    "--load": "weights only; the shape comes from --hf-config",
    "--tokenizer-model": "host only",
    "--data-path": "host only",
    "--eval-data-path": "host only",
    "--eval-interval": "the eval generates in rollout chunks: the rollout phase",
    "--task": "host only",
    "--train-iters": "how long",
    "--lr": "a scalar",
    "--lr-warmup-iters": "a scalar",
    "--clip-grad": "a scalar",
    "--weight-decay": "a scalar",
    "--loggra-update-interval": "how often the basis is refreshed, not its size",
    "--kl-ref-estimator": "per-token [b, s] log-probs either way",
    "--loss-aggregation": "a reduction",
    "--clip-low": "a scalar",
    "--clip-high": "a scalar",
    "--overlap-grad-reduce": "buckets of the same grad buffer",
    "--overlap-param-gather": "buckets of the same param buffer",
    "--save": "host",
    "--save-interval": "host",
    "--wandb-project": "host",
}


def estimator_cli():
    """``tools/estimate_memory.py`` as a module."""
    spec = importlib.util.spec_from_file_location(
        "estimate_memory_cli", os.path.join(ROOT, "tools", "estimate_memory.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def flag_list(words: list[str]) -> list[tuple[str, list[str]]]:
    """``[(flag, values)]`` of a command's words after the program."""
    flags: list[tuple[str, list[str]]] = []
    for word in words:
        if word.startswith("--"):
            flags.append((word, []))
        else:
            assert flags, f"a value before any flag: {word!r}"
            flags[-1][1].append(word)
    return flags


def command(text: str, start: str) -> list[str]:
    """The shell words after ``start`` of the backslash-continued command that begins so."""
    m = re.search(re.escape(start) + r"((?:[^\n]*\\\n)*[^\n]*)", text)
    assert m, f"no {start!r} command"
    return shlex.split(m[1].replace("\\\n", " "))


def torchrun_flags(path: str) -> list[tuple[str, list[str]]]:
    """``[(flag, values)]`` of the ``pretrain_rl.py`` command of a launch script."""
    m = re.search(r'pretrain_rl\.py \\\n(.*?)"\$@"', read(path), re.S)
    assert m, f"no pretrain_rl.py command in {path}"
    return flag_list(shlex.split(m[1].replace("\\\n", " ")))


def memory_argv(flags, estimator_flags: set[str]) -> list[str]:
    """The flags the estimator models, as its argv (less the memory-neutral ones); fails on a
    flag it does not have."""
    argv = []
    for flag, values in flags:
        assert flag in estimator_flags, f"{flag} is not a flag of tools/estimate_memory.py"
        if flag not in MEMORY_NEUTRAL:
            argv += [flag, *values]
    return argv


def exported(text: str) -> dict[str, str]:
    """``{NAME: value}`` of the ``export NAME=value ...`` lines of a script or document
    (``${NAME:-default}``: the default, as when NAME is not set)."""
    out = {}
    for m in re.finditer(r"^export ((?:\w+=\S+ ?)+)$", text, re.M):
        for name, value in (word.split("=", 1) for word in m[1].split()):
            out[name] = re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", value)
    return out


def env_flags(env: dict[str, str]) -> list[str]:
    """The estimator's counterparts of a launch environment (allocator, NCCL)."""
    flags = []
    if "expandable_segments:True" in env.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        flags.append("--expandable-segments")
    if env.get("NCCL_NVLS_ENABLE") == "0":
        flags.append("--no-nccl-nvls")
    return flags


def script_argv(path: str, world: int, estimator_flags: set[str]) -> list[str]:
    """The estimator's argv for a 27B launch script: its memory flags and environment."""
    flags = memory_argv(torchrun_flags(path), estimator_flags)
    argv = ["--hf-config", CONFIG_27B, "--world-size", str(world), "--gpu-memory-gb"]
    return [*argv, str(USABLE_GIB), *env_flags(exported(read(path))), *flags]


def without(argv: list[str], flag: str, values: int = 0) -> list[str]:
    """``argv`` less ``flag`` and its ``values`` values."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + values :]


def printed(cli, capsys, argv) -> str:
    """What the estimator prints for ``argv``."""
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def quoted(text: str) -> list[str]:
    """The two-decimal numbers of ``text`` (GiB as the estimator prints them)."""
    return re.findall(r"(?<![\d.])\d+\.\d\d(?![\d.])", text)


def assert_quotes(text: str, shown: str, where: str) -> None:
    """Every two-decimal number of ``text`` is one that ``shown`` (estimator output) has."""
    numbers = quoted(text)
    assert numbers, f"{where}: no numbers"
    missing = [q for q in numbers if q not in set(quoted(shown))]
    assert not missing, f"{where}: numbers the estimator does not print: {missing}"


def names_flag(err: str, flag: str) -> bool:
    """The estimator's error message (its stderr) is about ``flag``: ``pretrain_rl.py``'s
    ``--flag: ...``/``--flag=value: ...``, or argparse's ``argument --flag: ...``."""
    return re.search(rf"error: (argument )?{re.escape(flag)}\b", err) is not None
