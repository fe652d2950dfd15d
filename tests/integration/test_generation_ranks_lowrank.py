"""``--weight-sync lowrank``: the backward sketch's updates travel as their row factors and
draws, and the generation ranks' weights equal the trainer's bf16 weights bit for bit after
every sync (a checksum at every sync, ``--weight-sync-check-interval 1``).

* Against ``--weight-sync full`` on 2 training ranks + 1 generation rank: the same metrics in
  every step, the same trained weights, fewer bytes per sync; with remainders, a projection
  redrawn every 2 updates, predicted-KL control that shrinks every step, an update skipped
  for non-finite gradients and one rejected for a non-finite KL (``tests/helpers/
  faulty_steps.py``), after which the sync carries no row update.
* Training TP 2 → generation TP 1 with the other weights frozen (``--freeze-non-targets``),
  and a resume, whose first sync is a full one again.
"""

import pytest
import torch
from convert_cli import export_hf
from rl_runs import tiny_argv, torchrun

from loggra_megatron.metrics import read_metrics

pytestmark = pytest.mark.megatron

BASE = {
    "loggra-sketch": None,  # the backward sketch
    "bf16": True,
    "loggra-param-remainders": True,
    "loggra-refresh-interval": 2,
    "kl-coef": 0.01,
    "kl-target": 0.002,  # below every step's predicted KL: each is shrunk
    "train-iters": 4,
    "generation-ranks": 1,
    "weight-sync-check-interval": 1,
}
VOLATILE = ("time/", "throughput/", "memory/peak", "sync/")


def test_lowrank_sync_equals_the_full_sync_bit_for_bit(tokenizer, tmp_path):
    for sync in ("full", "lowrank"):
        flags = {**BASE, "weight-sync": sync, "save": tmp_path / sync, "train-iters": 5}
        torchrun(tiny_argv(tokenizer, **flags), nproc=3, script="tests/helpers/faulty_steps.py")
    full, low = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "lowrank")
    for a, b in zip(full, low, strict=True):
        assert b["sync/checksum_ok"] == 1.0
        for key in a:
            if not key.startswith(VOLATILE):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # steps 1 (non-finite gradients) and 2 (non-finite KL) change no weight (both updates of
    # each skipped); the others shrink
    assert [r["optimizer/skipped_steps"] for r in full] == [0, 2, 2, 0, 0]
    assert all(full[s]["kl/step_scale"] < 1 for s in (0, 3, 4))
    assert low[0]["sync/bytes"] > full[0]["sync/bytes"]  # the first: weights and masters
    assert all(b["sync/bytes"] < a["sync/bytes"] for a, b in zip(full[1:], low[1:], strict=True))
    # after a step that changed nothing (the syncs of steps 2 and 3), no row update travels
    assert max(low[s]["sync/bytes"] for s in (2, 3)) < min(low[s]["sync/bytes"] for s in (1, 4))
    ours, theirs = (
        export_hf(tmp_path / "full", tmp_path / "a"),
        export_hf(tmp_path / "lowrank", tmp_path / "b"),
    )
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_lowrank_sync_from_tp2_to_tp1_frozen_rest_and_resumed(tokenizer, tmp_path):
    flags = {
        **BASE,
        "kl-target": None,
        "weight-sync": "lowrank",
        "freeze-non-targets": True,
        "tensor-model-parallel-size": 2,
        "generation-tensor-model-parallel-size": 1,
        "prompts-per-step": 2,
        "global-batch-size": 8,
        "micro-batch-size": 4,
        "save": tmp_path,
    }
    torchrun(tiny_argv(tokenizer, **{**flags, "train-iters": 2}), nproc=3)
    torchrun(tiny_argv(tokenizer, **flags, load=tmp_path), nproc=3)
    rows = read_metrics(tmp_path)
    assert [r["sync/checksum_ok"] for r in rows] == [1.0] * 4
    first, later, resumed, after = (r["sync/bytes"] for r in rows)
    assert resumed == first > later == after > 0  # a resume starts with a full sync


@pytest.mark.parametrize("on_mismatch", ["stop", "resync"])
def test_a_corrupted_sync_stops_the_run_or_is_resent_in_full(tokenizer, tmp_path, on_mismatch):
    """The generation rank's first low-rank sync flips one bit (``tests/helpers/
    corrupt_sync.py``): the checksum catches it. ``stop`` ends the run naming the mismatch;
    ``resync`` generates nothing with those weights, sends a full sync and the request again,
    logs ``sync/checksum_ok`` 0 for that step, and trains exactly as the uncorrupted run."""
    flags = {**BASE, "kl-target": None, "train-iters": 3, "weight-sync": "lowrank"}
    flags["weight-sync-on-mismatch"] = on_mismatch
    argv = tiny_argv(tokenizer, **flags, save=tmp_path / "run")
    script = "tests/helpers/corrupt_sync.py"
    proc = torchrun(argv, nproc=3, check=on_mismatch == "resync", script=script)
    if on_mismatch == "stop":
        assert proc.returncode != 0
        assert "checksum mismatch" in proc.stdout + proc.stderr
        return
    clean = {**flags, "weight-sync-on-mismatch": None}
    torchrun(tiny_argv(tokenizer, **clean, save=tmp_path / "clean"), nproc=3)
    rows, expected = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "clean")
    assert [r["sync/checksum_ok"] for r in rows] == [1.0, 0.0, 1.0]
    assert rows[1]["sync/bytes"] > expected[1]["sync/bytes"]  # the full sync it took
    for a, b in zip(expected, rows, strict=True):
        for key in a:
            if not key.startswith(VOLATILE):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
