"""tools/convert_checkpoint.py --direction megatron-to-hf on pretrain_rl.py checkpoints: the
iteration is chosen, verified and falls back as --load does (tracker, sizes, CRC-32, finite
values), and every refusal exits 2 naming the file before anything is written."""

import math
import os
import struct

import pytest
import torch
import warm_launch
from convert_cli import CLI, cli_main, load_hf_dir

from loggra_megatron.model.args import GPTModelArgs
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

TINY = GPTModelArgs(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    vocab_size=64,
    make_vocab_size_divisible_by=1,
    max_position_embeddings=16,
)
EMBEDDING = "embedding.word_embeddings.weight"


def _trainer_checkpoints(rank, root, checksums):
    """Iterations 1 and 2 as pretrain_rl.py saves them; the first embedding entries are
    (v + 0.5, v) with v = the iteration."""
    from loggra_megatron.checkpointing import save_checkpoint
    from loggra_megatron.model.build import build_gpt_model

    model = build_gpt_model(TINY, use_cpu_initialization=True)
    for iteration in (1, 2):
        with torch.no_grad():
            dict(model.named_parameters())[EMBEDDING].view(-1)[:2] = torch.tensor(
                [iteration + 0.5, iteration]
            )
        save_checkpoint(root, iteration, [model], None, {}, checksums=checksums)
    TINY.save_json(os.path.join(root, "loggra_model_args.json"))


def _overwrite_in_iteration(root, iteration, old, new):
    path = os.path.join(root, f"iter_{iteration:07d}")
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        if name.endswith(".distcp") and old in data:
            with open(os.path.join(path, name), "wb") as f:
                f.write(data.replace(old, new, 1))
            return name
    raise AssertionError("bytes not found")


def _cli_run(rank, argv):
    """main() in this (initialised) process: ``(exit code, stderr)``."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        return cli_main(argv), err.getvalue()


def _to_hf(load, save, *extra):
    return ["--direction", "megatron-to-hf", "--load", str(load), "--save", str(save), *extra]


def test_megatron_to_hf_reads_trainer_checkpoints_as_the_trainer_does(tmp_path, capsys):
    """The converter used to export a flipped exponent (6.2e36), crash on a truncated shard
    (EOFError) and miss a tracker pointing at a missing iteration. Now it selects, verifies
    and falls back like --load: CRC-32, finite values, the newest complete iteration."""
    root = tmp_path / "ckpt"
    run_distributed(_trainer_checkpoints, 1, str(root), True)
    (root / "latest_checkpointed_iteration.txt").write_text("7")  # a missing iteration
    flip = struct.pack("<ff", 2.5, 2.0), struct.pack("<ff", 1e37, 2.0)
    name = _overwrite_in_iteration(root, 2, *flip)  # same size: only the CRC sees it
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = warm_launch.run(CLI, _to_hf(root, tmp_path / "hf"), env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    log = r.stdout + r.stderr
    assert "the tracked iteration 7" in log and f"{name} fails its CRC-32 check" in log
    assert "falling back to the newest complete checkpoint" in log and "iter_0000001" in log
    exported = load_hf_dir(tmp_path / "hf")["model.embed_tokens.weight"].view(-1)[:2]
    assert exported.tolist() == [1.5, 1.0]  # iteration 1, not the corrupted 2

    ((pinned, message),) = run_distributed(
        _cli_run, 1, _to_hf(root, tmp_path / "x", "--ckpt-step", "2")
    )
    assert pinned == 2 and "fails its CRC-32 check" in message and "--ckpt-step" in message
    assert not (tmp_path / "x").exists()
    for iteration in ("iter_0000001", "iter_0000002"):  # truncated shards: no EOFError
        with open(root / iteration / name, "r+b") as f:
            f.truncate(100)
    capsys.readouterr()
    assert cli_main(_to_hf(root, tmp_path / "y")) == 2  # refused before any process group
    assert "no complete checkpoint" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_megatron_to_hf_refuses_a_non_finite_weight(tmp_path):
    """Without checksums (sizes only) a NaN is still refused by the finite-value check."""
    root = tmp_path / "ckpt"
    run_distributed(_trainer_checkpoints, 1, str(root), False)
    _overwrite_in_iteration(
        root, 2, struct.pack("<ff", 2.5, 2.0), struct.pack("<ff", math.nan, 2.0)
    )
    ((code, message),) = run_distributed(_cli_run, 1, _to_hf(root, tmp_path / "hf"))
    assert code == 2 and "non-finite values" in message and EMBEDDING in message
