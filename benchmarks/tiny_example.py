"""The flags of ``examples/tiny_cpu/run.sh`` (its ``pretrain_rl.py`` command), read from the
script so that the benchmarks run what the example runs, and a way to change them."""

from __future__ import annotations

import os
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(ROOT, "examples", "tiny_cpu", "run.sh")


def example_flags() -> list[str]:
    """The ``pretrain_rl.py`` flags of examples/tiny_cpu/run.sh, without ``--save`` and
    ``"$@"`` (``--tokenizer-model`` as written there: set it with ``with_flags``)."""
    with open(RUN_SH, encoding="utf-8") as f:
        text = f.read()
    block = text[text.index("torchrun") : text.index('"$@"')]
    words = shlex.split(block.replace("\\\n", " "), posix=True)
    words = words[words.index("pretrain_rl.py") + 1 :]
    i = words.index("--save")
    return words[:i] + words[i + 2 :]


def with_flags(flags: list[str], **values) -> list[str]:
    """``flags`` with ``--name value`` set (None: dropped), by Python name."""
    out, skip = [], False
    names = {f"--{k.replace('_', '-')}": v for k, v in values.items()}
    for j, word in enumerate(flags):
        if skip:
            skip = False
            continue
        if word in names:
            skip = j + 1 < len(flags) and not flags[j + 1].startswith("--")
            continue
        out.append(word)
    for name, value in names.items():
        if value is not None:
            out += [name, str(value)]
    return out
