"""``tools/train_tokenizer.py`` as a user runs it: a sentencepiece model of the built-in tasks
that round-trips their text."""

import os
import subprocess
import sys
from pathlib import Path

from loggra_megatron.data.tokenizer import SentencePieceTokenizer

REPO = str(Path(__file__).resolve().parents[2])


def test_train_tokenizer_cli(tmp_path):
    prefix = tmp_path / "out" / "math"
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "train_tokenizer.py"),
        "--builtin-tasks",
        "500",
        "--seed",
        "1",
        "--vocab-size",
        "256",
        "--model-type",
        "unigram",
        "--output-prefix",
        str(prefix),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"wrote {prefix}.model" in result.stdout
    tok = SentencePieceTokenizer(f"{prefix}.model")
    assert 100 < tok.vocab_size <= 256
    assert tok.detokenize(tok.tokenize("What is 12 + 7?")) == "What is 12 + 7?"
