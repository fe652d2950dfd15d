"""MetricsLogger: JSONL contents, rank gating, resume truncation, progress line, W&B, TensorBoard."""

import importlib.util
import json
import math
from pathlib import Path

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
from loggra_megatron.metrics import MetricsLogger, read_metrics, resolve_wandb_mode

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
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)


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
