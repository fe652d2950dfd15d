"""``pretrain_rl.py --loggra-sketch backward`` end to end: DP=2 with KL control, bf16 grads
and remainders; save → resume equals the uninterrupted run in every metric; a changed seed,
rank, target set, row optimizer, projection matrix, refresh interval or sketch mode is refused on resume (exit 2); the trained
weights export to Hugging Face."""

import pytest
import torch
import warm_launch
from convert_cli import CLI, load_hf_dir
from rl_runs import refused, tiny_argv, torchrun

from loggra_megatron.metrics import read_metrics

pytestmark = pytest.mark.megatron

BACKWARD = {
    "loggra-sketch": "backward",
    "loggra-min-dim": None,  # a gradient-sketch setting: refused with backward
    "train-iters": 4,
    "bf16": True,
    "kl-coef": 0.01,
    "kl-target": 0.05,
    "grad-reduce-in-bf16": True,
    "loggra-param-remainders": True,
    "save-interval": 2,
}


@pytest.fixture(scope="module")
def runs(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("backward")
    torchrun(tiny_argv(tokenizer, **BACKWARD, save=root / "full"))
    torchrun(tiny_argv(tokenizer, **{**BACKWARD, "train-iters": 2}, save=root / "part"))
    torchrun(tiny_argv(tokenizer, **BACKWARD, save=root / "part", load=root / "part"))
    return root


def test_resume_equals_uninterrupted_and_reports_the_sketch(runs):
    """The end-to-end resume (the optimizers' own resumes are proven bitwise in
    ``test_megatron_optimizer_checkpoint.py``): DP=2, the backward sketch with remainders and
    bf16 gradients, KL control; every metric of steps 3-4 equals the uninterrupted run's."""
    full, part = read_metrics(runs / "full"), read_metrics(runs / "part")
    volatile = ("time/", "throughput/", "memory/peak")
    # the probe-skip state crosses the resume: some updates of steps 3-4 skip the probe
    assert any(r["kl/probe_skipped"] > 0 for r in full[2:])
    for a, b in zip(full, part, strict=True):
        for key in a:
            if not key.startswith(volatile):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    for row in full:
        assert row["memory/sketch_buffer_bytes"] > 0
        assert row["memory/grad_buffer_bytes"] > 0
        assert row["loggra/sketch_norm"] > 0 and row["grad/norm"] >= row["loggra/sketch_norm"]
        assert 0 < row["kl/step_scale"] <= 1


def test_changed_sketch_settings_are_refused_on_resume(tokenizer, runs, capsys):
    base = {**BACKWARD, "load": runs / "part", "save": runs / "part", "train-iters": 6}
    for change, needle in (
        ({"loggra-seed": 99}, "--loggra-seed: the checkpoint was saved with --loggra-seed 7"),
        ({"loggra-rank": 4}, "--loggra-rank: the checkpoint was saved with --loggra-rank 8"),
        ({"loggra-targets": "linear_qkv,linear_fc1"}, "--loggra-targets: the checkpoint"),
        ({"loggra-row-optimizer": "sgd"}, "--loggra-row-optimizer: the checkpoint"),
        ({"loggra-sketch-matrix": "gaussian"}, "--loggra-sketch-matrix: the checkpoint"),
        ({"loggra-refresh-interval": 2}, "--loggra-refresh-interval: the checkpoint"),
        (
            {"loggra-sketch": "gradient", "loggra-min-dim": 16},
            "--loggra-sketch: the checkpoint was saved with --loggra-sketch backward",
        ),
    ):
        refused(tiny_argv(tokenizer, **{**base, **change}), capsys, needle, "--no-load-optim")


def test_gradient_settings_are_refused_with_the_backward_sketch(tokenizer, capsys):
    refused(
        tiny_argv(tokenizer, **{**BACKWARD, "loggra-min-dim": 16}),
        capsys,
        "--loggra-min-dim=16: applies to --optimizer loggra --loggra-sketch gradient only",
    )
    refused(
        tiny_argv(tokenizer, **{**BACKWARD, "loggra-targets": "linear_qkv,mlp"}),
        capsys,
        "--loggra-targets='linear_qkv,mlp': must be distinct names from linear_qkv",
    )


def test_trained_target_weights_export_to_hugging_face(runs, tmp_path):
    exports = {}
    for step in (2, 4):
        out = tmp_path / f"hf{step}"
        _convert("--load", str(runs / "full"), "--save", str(out), "--ckpt-step", str(step))
        exports[step] = load_hf_dir(out)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    names = [n for n in exports[4] if n.endswith(".weight") and any(t in n for t in targets)]
    assert len(names) == 2 * len(targets)
    for name in names:  # the sketched targets were trained between steps 2 and 4
        assert not torch.equal(exports[2][name], exports[4][name]), name


def test_exported_masters_are_the_weights_before_bf16_rounding(runs, tmp_path):
    """``--export-masters`` of a bf16 run (masters kept as bf16 weight + int16 remainder):
    float32 tensors that round to the exported bf16 weights (all but exact ties, which the
    remainders round up in magnitude), and that hold more than the weights do."""
    exports = {}
    for name, extra in (("weights", []), ("masters", ["--export-masters"])):
        _convert("--load", str(runs / "full"), "--save", str(tmp_path / name), *extra)
        exports[name] = load_hf_dir(tmp_path / name)
    weights, masters = exports["weights"], exports["masters"]
    assert weights.keys() == masters.keys()
    finer = 0
    for name, master in masters.items():
        assert master.dtype == torch.float32 and weights[name].dtype == torch.bfloat16, name
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(master.bfloat16()[~tie], weights[name][~tie]), name
        finer += not torch.equal(master, weights[name].float())
    assert finer == len(masters)  # every weight was trained, and its master is finer


def _convert(*argv: str) -> None:
    """tools/convert_checkpoint.py --direction megatron-to-hf ``argv``, as a user runs it."""
    proc = warm_launch.run(CLI, ["--direction", "megatron-to-hf", *argv])
    assert proc.returncode == 0, proc.stderr[-3000:]
