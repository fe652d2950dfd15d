"""A resume keeps the optimizer mode its checkpoint was written in unless ``--loggra-sketch``
is given (the default mode has changed since older checkpoints were written), decided
before any process group from the checkpoint's ``run_config.json``."""

import json
import zlib

from rl_runs import refused, tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.checkpointing.layout import MANIFEST, MODEL_ARGS, RUN_CONFIG, TRACKER


def _gradient_checkpoint(tokenizer, root):
    """A checkpoint directory as a ``--loggra-sketch gradient`` run leaves it (its settings,
    architecture, tracker and manifest; no tensors are read before the process group)."""
    from loggra_megatron.data.tokenizer import load_tokenizer

    argv = tiny_argv(tokenizer, **{"loggra-sketch": "gradient"})
    cfg = parse_args(argv, world_size=2)
    iteration = root / "iter_0000002"
    iteration.mkdir(parents=True)
    files = {
        RUN_CONFIG: json.dumps({"flags": cfg.flags(), "step": 2}, default=str),
        "metadata.json": "{}",
    }
    for name, text in files.items():
        (iteration / name).write_text(text)
    table = {n: {"bytes": len(t), "crc32": zlib.crc32(t.encode())} for n, t in files.items()}
    (iteration / MANIFEST).write_text(json.dumps({"format": 1, "files": table}))
    (root / TRACKER).write_text("2")
    vocab = load_tokenizer(str(tokenizer)).vocab_size
    cfg.model.model_args(vocab).save_json(str(root / MODEL_ARGS))
    return argv


def test_a_resume_keeps_the_checkpoints_mode_unless_given(tokenizer, tmp_path, capsys):
    root = tmp_path / "run"
    argv = _gradient_checkpoint(tokenizer, root)
    # the same command line without --loggra-sketch (its --loggra-min-dim is the gradient
    # sketch's, and would be refused under the new default)
    resumed = [*argv[: argv.index("--loggra-sketch")], *argv[argv.index("--loggra-sketch") + 2 :]]
    resumed += ["--load", str(root), "--save", str(root)]
    cfg = parse_args(resumed, world_size=2)
    assert cfg.start.resumes and cfg.loggra.loggra_sketch == "gradient"
    assert any("--loggra-sketch gradient (the checkpoint's" in n for n in cfg.start.notes)
    # given, the flag is the user's choice, and the saved state is then refused
    refused(
        [*resumed, "--loggra-sketch", "backward", "--loggra-min-dim", "32"],
        capsys,
        "--loggra-min-dim=32: applies to --optimizer loggra --loggra-sketch gradient only",
    )
    without_min_dim = [a for a in resumed if a not in ("--loggra-min-dim", "16")]
    refused(
        [*without_min_dim, "--loggra-sketch", "backward"],
        capsys,
        "--loggra-sketch: the checkpoint was saved with --loggra-sketch gradient",
    )


def test_a_fresh_run_takes_the_published_mode_by_default(tokenizer):
    argv = tiny_argv(tokenizer, **{"loggra-sketch": None})
    assert parse_args(argv, world_size=2).loggra.loggra_sketch == "backward"
