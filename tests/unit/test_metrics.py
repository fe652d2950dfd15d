"""MetricsLogger: JSONL contents, rank gating, resume truncation, progress line, W&B, TensorBoard."""

import errno
import importlib.util
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loggra_megatron import metrics as M
from loggra_megatron.metric_keys import (
    METRICS,
    add_update,
    combine_micro_batches,
    combine_updates,
    with_table,
)
from loggra_megatron.metrics import (
    MetricsLogger,
    MetricsWriteError,
    read_metrics,
    resolve_wandb_mode,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _step_metrics(step):
    return {"reward/mean": 0.1 * step, "loss/total": 1.0 / step, "time/step_s": 2.0}


def test_jsonl_one_sorted_line_per_step(tmp_path):
    with MetricsLogger(tmp_path / "run", total_steps=3) as log:
        for step in (1, 2, 3):
            log.log(step, {"lr": 1e-5, "kl/ref": torch.tensor(0.25), "clip/fraction": 0})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert list(first) == ["step", "clip/fraction", "kl/ref", "lr"]
    assert first == {"step": 1, "clip/fraction": 0, "kl/ref": 0.25, "lr": 1e-5}
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_lines_are_on_disk_before_close(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log(1, {"loss/total": 0.5})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss/total": 0.5}]
    log.close()
    log.close()  # idempotent


def test_non_finite_values_are_null(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"kl/predicted": float("nan"), "grad/norm": math.inf, "lr": None})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 1, "grad/norm": None, "kl/predicted": None, "lr": None}


def test_rejects_bad_metrics(tmp_path):
    with MetricsLogger(tmp_path) as log:
        with pytest.raises(ValueError, match="step"):
            log.log(1, {"step": 1})
        with pytest.raises(TypeError, match="reward/mean"):
            log.log(1, {"reward/mean": "high"})


def test_non_zero_rank_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    with MetricsLogger(out, rank=1, total_steps=10, wandb_project="p", wandb_mode="offline") as log:
        log.log(1, _step_metrics(1))
        log.truncate_after(0)
        assert log.wandb_mode == "disabled"
    assert not out.exists()
    assert capsys.readouterr().out == ""


def test_truncate_after_matches_uninterrupted_run(tmp_path):
    with MetricsLogger(tmp_path / "straight") as log:
        for step in range(1, 6):
            log.log(step, _step_metrics(step))
    with MetricsLogger(tmp_path / "resumed") as log:  # crashes after step 4, checkpoint at 3
        for step in range(1, 5):
            log.log(step, _step_metrics(step))
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/me')  # a line cut short by the crash
    with MetricsLogger(tmp_path / "resumed") as log:
        log.truncate_after(3)
        assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3]
        for step in (4, 5):
            log.log(step, _step_metrics(step))
    straight = (tmp_path / "straight" / "metrics.jsonl").read_bytes()
    assert (tmp_path / "resumed" / "metrics.jsonl").read_bytes() == straight

    with MetricsLogger(tmp_path / "resumed") as log:  # a fresh start in the same dir
        log.truncate_after(0)
    assert read_metrics(tmp_path / "resumed") == []


def test_resume_moves_lines_without_a_step_aside_and_names_them(tmp_path, capsys):
    """A malformed line in the middle and a record without ``step`` used to be
    dropped without a word at resume; they are kept in metrics.rejected.jsonl now."""
    run = tmp_path / "run"
    with MetricsLogger(run) as log:
        for step in range(1, 4):
            log.log(step, _step_metrics(step))
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    edited = [lines[0], "{not json", lines[1], '{"note": "a hand-written line"}', lines[2]]
    path.write_text("\n".join(edited) + "\n" + '{"step": 4, "rew')
    with MetricsLogger(run) as log:
        log.truncate_after(2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    side = (run / "metrics.rejected.jsonl").read_text().splitlines()
    assert side == ["{not json", '{"note": "a hand-written line"}', '{"step": 4, "rew']
    out = capsys.readouterr().out
    assert "3 line(s) without a record of an integer step (line 2, 4, 6)" in out


def test_read_metrics_ignores_cut_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lr"')
    assert read_metrics(path) == [{"step": 1}]
    path.write_bytes(b'{"step": 1}\n{"step": 2, "lr": \xe2\x82')  # cut inside a character
    assert read_metrics(path) == [{"step": 1}]
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=f"^{path}:1: not a JSON line"):
        read_metrics(path)
    path.write_bytes(b'{"step": 1}\n{"step": 2, "lr": 0.\xff}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"^{path}:2: not a JSON line"):
        read_metrics(path)


def _lines(*records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def test_resume_moves_a_line_that_is_not_utf8_aside(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    bad = b'{"step": 2, "lr": 0.\xff\xfe}'
    (run / "metrics.jsonl").write_bytes(_lines({"step": 1}) + bad + b"\n" + _lines({"step": 2}))
    with MetricsLogger(run) as log:
        log.truncate_after(2)
    assert read_metrics(run) == [{"step": 1}, {"step": 2}]
    assert (run / "metrics.rejected.jsonl").read_bytes() == bad + b"\n"  # as it was
    assert "1 line(s) without a record of an integer step (line 2) moved to" in (
        capsys.readouterr().out
    )


def test_resume_keeps_the_last_record_of_a_step_logged_twice(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    first = [{"step": 1, "lr": 1}, {"step": 2, "lr": 1}, {"step": 3, "lr": 1}]
    again = [{"step": 2, "lr": 2}, {"step": 3, "lr": 2}, {"step": 4, "lr": 2}]
    (run / "metrics.jsonl").write_bytes(_lines(*first, *again))
    with pytest.warns(UserWarning, match=r"step 2 at lines 2 and 4; step 3 at lines 3 and 5"):
        assert read_metrics(run) == [first[0], *again]
    with MetricsLogger(run) as log:
        log.truncate_after(3)
    assert read_metrics(run) == [first[0], *again[:2]]
    out = capsys.readouterr().out
    assert "2 step(s) recorded more than once (step 2 at lines 2 and 4; step 3 at lines 3 and " in (
        out
    )
    assert "kept the last; line 2, 3 moved to" in out
    assert (run / "metrics.rejected.jsonl").read_bytes() == _lines(first[1], first[2])


def test_resume_repairs_an_unterminated_last_record_and_moves_a_torn_one_aside(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    path.write_bytes(_lines({"step": 1}) + b'{"step": 2}')  # the newline was not written
    with MetricsLogger(run) as log:
        log.truncate_after(2)
        log.log(3, {"lr": 1.0})
    assert path.read_bytes() == _lines({"step": 1}, {"step": 2}, {"step": 3, "lr": 1.0})
    path.write_bytes(_lines({"step": 1}) + b'{"step": 2, "l')  # torn inside the record
    with MetricsLogger(run) as log:
        log.truncate_after(2)
        log.log(2, {"lr": 1.0})
    assert path.read_bytes() == _lines({"step": 1}, {"step": 2, "lr": 1.0})
    assert (run / "metrics.rejected.jsonl").read_bytes() == b'{"step": 2, "l\n'


class _FullDisk:
    """The logger's file on a disk that fills after ``room`` more bytes."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.file.write(bytes(data[: self.room]))  # the torn start of the line
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_stops_the_run_with_one_line_and_no_torn_record(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log(1, {"lr": 1.0})
    log._file = _FullDisk(log._file, room=10)
    with pytest.raises(MetricsWriteError) as full:
        log.log(2, {"lr": 1.0})
    message = str(full.value)
    assert "\n" not in message and "No space left on device" in message, message
    assert message.startswith(f"--output-dir: writing step 2 to {log.path} failed"), message
    assert log.path.read_bytes() == _lines({"step": 1, "lr": 1.0})  # the torn start removed
    log.close()


def test_a_full_disk_at_fsync_also_stops_the_run(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with MetricsLogger(tmp_path) as log:
        monkeypatch.setattr(M.os, "fsync", full)
        with pytest.raises(MetricsWriteError, match="No space left on device"):
            log.log(1, {"lr": 1.0})
    assert read_metrics(tmp_path) == []


def test_a_full_disk_at_resume_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_lines({"step": 1}, {"step": 2}))
    log = MetricsLogger(tmp_path)
    monkeypatch.setattr(M.os, "fsync", lambda fd: os.write(-1, b""))  # EBADF: any OSError
    with pytest.raises(MetricsWriteError, match="rewriting .* for the resume after step 1"):
        log.truncate_after(1)
    assert path.read_bytes() == _lines({"step": 1}, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary
    log.close()


@pytest.mark.parametrize("saved", [True, False])
def test_pretrain_rl_names_the_checkpoint_to_resume_from_when_the_disk_fills(
    tmp_path, monkeypatch, capsys, saved
):
    import pretrain_rl  # noqa: F401  (the repository root is on sys.path under pytest)

    save = tmp_path / "ckpt"
    save.mkdir()
    if saved:
        (save / "latest_checkpointed_iteration.txt").write_text("5")

    class Trainer:
        def __init__(self, cfg, host, **kwargs):
            pass

        def setup(self):
            return self

        def train(self):
            log = MetricsLogger(tmp_path / "out")
            log._file = _FullDisk(log._file, room=0)
            log.log(7, {"lr": 1.0})

    cfg = SimpleNamespace(
        checkpoint=SimpleNamespace(save=str(save)),
        logging=None,
        start=SimpleNamespace(seen=None),
        placement=SimpleNamespace(generation_ranks=0, disaggregated=False),
    )
    monkeypatch.setattr(pretrain_rl, "parse_args", lambda argv: cfg)
    monkeypatch.setattr(pretrain_rl, "preflight", lambda cfg: SimpleNamespace(notes=[]))
    monkeypatch.setattr(pretrain_rl, "claim_run_directories", lambda *args: [])
    monkeypatch.setattr(pretrain_rl, "RLTrainer", Trainer)
    with pytest.raises(SystemExit) as stopped:
        pretrain_rl.main([])
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "writing step 7" in err and "No space left on device" in err, err
    if saved:
        last = save / "iter_0000005"
        assert f"the last checkpoint is {last} (step 5): resume from it with --load {save}" in err
    else:
        assert f"--save {save} holds no checkpoint yet" in err, err


def test_progress_line(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=200) as log:
        log.log(
            12,
            {
                "reward/mean": 0.412,
                "kl/ref": 0.0031,
                "kl/predicted": 0.02,
                "kl/step_scale": 0.71,
                "loss/total": 0.153,
                "throughput/tokens_per_s": 5200.0,
                "memory/peak_bytes": 3.1 * 2**30,
                "time/step_s": 2.0,
                "lr": 1e-6,
            },
        )
        log.log(13, {"time/step_s": 4.0})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0] == (
        " step    12/200 | reward 0.412 | kl/ref 0.0031 | kl/pred 0.02 η 0.71 | loss 0.153"
        " | 5.2k tok/s | mem 3.1 GiB | ETA 0:06:16"
    )
    assert out[1] == " step    13/200 | ETA 0:09:21"  # 187 steps × mean(2, 4) s


def test_progress_line_says_when_updates_are_skipped(tmp_path):
    """A step whose updates were not applied (non-finite) says so where the user looks."""
    log = MetricsLogger(tmp_path, rank=0)
    kept = log.progress_line(
        3, {"optimizer/skipped_steps": 0.0, "optimizer/skipped_steps_total": 2.0}
    )
    assert "SKIPPED" not in kept
    line = log.progress_line(
        4, {"optimizer/skipped_steps": 1.0, "optimizer/skipped_steps_total": 3.0}
    )
    assert line == " step      4 | SKIPPED 1 update(s), 3 in all"
    log.close()


def test_progress_line_without_total_or_step_time(tmp_path):
    log = MetricsLogger(tmp_path, rank=0)
    line = log.progress_line(7, {"kl/step_scale": 0.5})
    assert line == " step      7 | η 0.5"
    log.close()


def test_wandb_mode_rule(tmp_path):
    no_netrc = {"NETRC": str(tmp_path / "missing")}
    assert resolve_wandb_mode(None, "online", {"WANDB_API_KEY": "k"}) == "disabled"
    assert resolve_wandb_mode("p", "online", no_netrc) == "online"
    assert resolve_wandb_mode("p", None, {**no_netrc, "WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_wandb_mode("p", None, no_netrc) == "offline"
    assert resolve_wandb_mode("p", None, {**no_netrc, "WANDB_API_KEY": "k"}) == "online"
    rc = tmp_path / "netrc"
    rc.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert resolve_wandb_mode("p", None, {"NETRC": str(rc)}) == "online"
    other = {"NETRC": str(rc), "WANDB_BASE_URL": "https://wandb.example.com"}
    assert resolve_wandb_mode("p", None, other) == "offline"  # key is for another host


@pytest.fixture
def offline_wandb_env(tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (("DIR", "wandb-dir"), ("CONFIG_DIR", "cfg"), ("CACHE_DIR", "cache")):
        monkeypatch.setenv(f"WANDB_{var}", str(tmp_path / sub))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))


def test_wandb_offline_without_credentials(tmp_path, offline_wandb_env):
    out = tmp_path / "run"
    config = {"lr": 1e-6, "kl_target": 0.01}
    with MetricsLogger(out, total_steps=2, wandb_project="loggra-test", config=config) as log:
        assert log.wandb_mode == "offline"
        assert dict(log._wandb_run.config) == config
        log.log(1, {"reward/mean": 0.5, "kl/predicted": float("nan")})
        log.log(2, {"reward/mean": 0.6})
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))
    assert len(read_metrics(out)) == 2


def test_wandb_online_failure_falls_back_to_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step))

        def finish(self):
            calls.append(("finish", None))

    def fake_init(mode, **kwargs):
        calls.append(("init", mode))
        assert kwargs["dir"] == str(tmp_path) and kwargs["project"] == "p"
        if mode == "online":
            raise TimeoutError("no network")
        return FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    with MetricsLogger(tmp_path, wandb_project="p", wandb_mode="online") as log:
        assert log.wandb_mode == "offline"
        log.log(3, {"lr": 1.0})
    assert calls == [("init", "online"), ("init", "offline"), ("log", 3), ("finish", None)]


def test_wandb_disabled_without_project(tmp_path, offline_wandb_env):
    with MetricsLogger(tmp_path, wandb_project=None, wandb_mode="online") as log:
        assert log.wandb_mode == "disabled" and log._wandb_run is None
        log.log(1, {"lr": 1.0})
    assert not (tmp_path / "wandb").exists()


def test_tensorboard_missing_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="--tensorboard-dir"):
        MetricsLogger(tmp_path, rank=1, tensorboard_dir=tmp_path / "tb")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="no tensorboard")
def test_tensorboard_writes_events(tmp_path):
    with MetricsLogger(tmp_path, tensorboard_dir=tmp_path / "tb") as log:
        log.log(1, {"reward/mean": 0.5, "kl/ref": 0.01})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_docs_table_is_generated_from_the_declarations():
    docs = DOCS.read_text()
    assert all(f"| `{key}` |" in docs for key in METRICS)
    assert with_table(docs) == docs, (
        "docs/metrics.md's table differs from loggra_megatron/metric_keys.py: run "
        "`python -m loggra_megatron.metric_keys docs/metrics.md`"
    )


def test_reductions_follow_the_declarations():
    micro = [{"loss/total": 0.25, "kl/ref": 0.1}, {"loss/total": 0.5, "kl/ref": 0.3}]
    assert combine_micro_batches(micro) == {"loss/total": 0.75, "kl/ref": 0.2}  # share; mean
    sums = {"loss/total": 1.5, "optimizer/skipped_steps": 1.0, "time/kl_control_s": 0.75}
    assert combine_updates(sums, 3) == {
        "loss/total": 0.5,
        "optimizer/skipped_steps": 1.0,
        "time/kl_control_s": 0.75,
    }
    sums = {}
    for update in (
        {"loss/total": 1.0, "rollout/logprob_mismatch": 0.02},
        {"loss/total": 3.0, "rollout/logprob_mismatch": 0.5},
    ):
        add_update(sums, update)
    # the mismatch is the first update's: later updates measure a policy already moved
    assert combine_updates(sums, 2) == {"loss/total": 2.0, "rollout/logprob_mismatch": 0.02}
    with pytest.raises(KeyError, match="not declared"):
        combine_micro_batches([{"my/metric": 1.0}])
    with pytest.raises(KeyError, match="over updates"):
        combine_updates({"reward/mean": 1.0}, 1)  # measured once per step, not per update
