"""Which checkpoint a directory holds, decided before any process group: complete only with a
valid manifest that describes the directory, interrupted saves that are no checkpoint,
converted models that are never overwritten, unwritable --save, tracker messages."""

import json
import os
import re
import zlib

import pytest
from rl_runs import refused, tiny_argv

from loggra_megatron.arguments import parse_args
from loggra_megatron.checkpointing.layout import (
    MANIFEST,
    MODEL_ARGS,
    RUN_CONFIG,
    TRACKER,
    has_checkpoint,
    remove_interrupted_saves,
    select_checkpoint,
)


def _write_checkpoint(root, iteration, files=None, manifest=True, name=None):
    """An iteration directory as a save leaves it: ``files`` ({name: text}) and a manifest
    of their sizes and CRC-32 (written last)."""
    path = root / (name or f"iter_{iteration:07d}")
    path.mkdir(parents=True)
    files = files or {"metadata.json": "{}", "__0_0.distcp": "w" * (10 + iteration)}
    for name, text in files.items():
        (path / name).write_text(text)
    table = {n: {"bytes": len(t), "crc32": zlib.crc32(t.encode())} for n, t in files.items()}
    if manifest:
        (path / MANIFEST).write_text(json.dumps({"format": 1, "files": table}))
    return path


@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        (None, "it is missing"),
        ("garbage{", "JSONDecodeError"),
        ('{"files": {}}', "lists no files"),
        ('{"files": []}', "lists no files"),  # was an AttributeError
        ('{"files": {"metadata.json": {"crc32": 1}}}', "malformed entry for 'metadata.json'"),
        ('{"files": {"metadata.json": {"bytes": 2}}}', "__0_0.distcp is not in the manifest"),
    ],
)
def test_a_missing_or_invalid_manifest_means_incomplete_never_trusted(tmp_path, manifest, why):
    """A checkpoint this project wrote always has a manifest that lists its files: without
    one the tracked iteration is an interrupted save, and the load falls back (it used to be
    trusted as a "legacy" checkpoint, unverified)."""
    root = tmp_path / "ckpt"
    _write_checkpoint(root, 1)
    latest = _write_checkpoint(root, 2)
    (root / TRACKER).write_text("2")
    (latest / MANIFEST).unlink()
    if manifest is not None:
        (latest / MANIFEST).write_text(manifest)
    ref = select_checkpoint(str(root))
    assert ref.iteration == 1, ref
    assert why in ref.warnings[0] and "falling back" in ref.warnings[-1]
    with pytest.raises(FileNotFoundError, match=re.escape(why)):
        select_checkpoint(str(root), iteration=2)


def test_a_garbled_run_config_is_caught_at_selection_and_falls_back(tmp_path):
    """run_config.json (the flags a resume is checked against) is small: its CRC-32 is
    checked before any process starts, so a garbled copy of the same size is never read."""
    root = tmp_path / "ckpt"
    config = json.dumps({"flags": {"seed": 1}, "step": 1})
    _write_checkpoint(root, 1, {RUN_CONFIG: config, "metadata.json": "{}"})
    latest = _write_checkpoint(root, 2, {RUN_CONFIG: config, "metadata.json": "{}"})
    (root / TRACKER).write_text("2")
    (latest / RUN_CONFIG).write_text(config.replace("{", "[", 1))  # same size
    ref = select_checkpoint(str(root))
    assert ref.iteration == 1 and "run_config.json fails its CRC-32 check" in ref.warnings[0]


def _strip_crc32(path, *names):
    """Remove the CRC-32 of ``names`` (all files without any) from the manifest of ``path``."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        if name in names or not names:
            del entry["crc32"]
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_a_crc32_removed_from_the_manifest_makes_it_damaged(tmp_path):
    """A save records the CRC-32 of every file, or of none (--no-checkpoint-checksums): an
    entry stripped of its CRC-32 over damaged bytes used to load without a note."""
    root = tmp_path / "ckpt"
    _write_checkpoint(root, 1)
    latest = _write_checkpoint(root, 2)
    (root / TRACKER).write_text("2")
    _strip_crc32(latest, "__0_0.distcp")
    (latest / "__0_0.distcp").write_text("W" * 12)  # damaged, the same size
    ref = select_checkpoint(str(root))
    why = "__0_0.distcp has no CRC-32 in manifest.json, unlike the other files"
    assert ref.iteration == 1 and why in ref.warnings[0], ref
    with pytest.raises(FileNotFoundError, match=why):
        select_checkpoint(str(root), iteration=2)


@pytest.mark.parametrize("asked", [True, False])
def test_a_manifest_of_sizes_only_is_damaged_unless_its_run_asked_for_it(tmp_path, asked):
    root = tmp_path / "ckpt"
    config = json.dumps({"flags": {"checkpoint_checksums": asked}, "step": 1})
    path = _write_checkpoint(root, 1, {RUN_CONFIG: config, "metadata.json": "{}"})
    (root / TRACKER).write_text("1")
    _strip_crc32(path)
    if not asked:  # --no-checkpoint-checksums
        assert select_checkpoint(str(root)).iteration == 1
        return
    with pytest.raises(FileNotFoundError, match="lists no CRC-32, though its run saved with"):
        select_checkpoint(str(root))


def test_an_interrupted_first_save_is_no_checkpoint_and_is_removed(tokenizer, tmp_path):
    """kill -9 during the first save leaves iter_0000001.tmp without a manifest and no
    tracker: the auto-resume command starts fresh (it used to exit 2 forever), a fresh run
    may use the directory, and the run that claims it reclaims the space."""
    save = tmp_path / "ckpt"
    stale = _write_checkpoint(save, 1, manifest=False)
    stale.rename(save / "iter_0000001.tmp")
    assert not has_checkpoint(str(save))
    assert parse_args(tiny_argv(tokenizer, load=save, save=save)).start.mode == "fresh"
    assert parse_args(tiny_argv(tokenizer, save=save)).start.mode == "fresh"
    complete = _write_checkpoint(save, 2)  # a complete .tmp (a crash before its rename) stays
    complete.rename(save / "iter_0000002.tmp")
    assert remove_interrupted_saves(str(save)) == [str(save / "iter_0000001.tmp")]
    assert sorted(os.listdir(save)) == ["iter_0000002.tmp"]


def _converted_model(path, tokenizer):
    """The layout tools/convert_checkpoint.py writes (release + architecture)."""
    cfg = parse_args(tiny_argv(tokenizer))
    _write_checkpoint(path, 0, name="release")
    (path / TRACKER).write_text("release\n")
    cfg.model.model_args(192).save_json(path / MODEL_ARGS)


def test_a_converted_model_is_never_replaced_by_a_run(tokenizer, tmp_path, capsys):
    """--load C --save C on a converted model used to start from random weights (the plan
    said "fresh") and overwrite C's tracker; any --save C is refused now, and --load C loads
    the converted model."""
    converted = tmp_path / "converted"
    _converted_model(converted, tokenizer)
    argv = tiny_argv(tokenizer, load=converted, save=converted)
    refused(argv, capsys, "--save", "holds a converted model", "give --save another directory")
    refused(tiny_argv(tokenizer, save=converted), capsys, "holds a converted model")
    cfg = parse_args(tiny_argv(tokenizer, load=converted, save=tmp_path / "run"))
    assert cfg.start.mode == "converted"
    assert (converted / TRACKER).read_text() == "release\n"


def test_an_unwritable_save_is_refused_before_training(tokenizer, tmp_path, capsys):
    """Found at parse time (exit 2), not at the first save after training ran."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(tiny_argv(tokenizer, save=afile), capsys, "--save", "is a file, not a directory")
    refused(
        tiny_argv(tokenizer, save=afile / "sub"), capsys, "--save", f"is under the file {afile}"
    )
    refused(tiny_argv(tokenizer, **{"output-dir": afile}), capsys, "--output-dir", "is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_save_is_refused_before_training(tokenizer, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    refused(tiny_argv(tokenizer, save=ro / "ckpt"), capsys, "--save", "is not writable")


@pytest.mark.parametrize("text", ["abc", "release", "-1"])
def test_a_tracker_without_an_iteration_is_reported_as_it_is(tokenizer, tmp_path, capsys, text):
    """It used to be reported as a missing tracker."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / TRACKER).write_text(text)
    if text == "release":  # a converted model without its files
        refused(tiny_argv(tokenizer, load=root), capsys, "release is missing")
        return
    refused(tiny_argv(tokenizer, load=root), capsys, f"holds {text!r}, not an iteration number")
    _write_checkpoint(root, 3)
    ref = select_checkpoint(str(root))
    assert ref.iteration == 3 and f"holds {text!r}, not an iteration number" in ref.warnings[0]


def test_a_converted_model_without_its_manifest_is_refused(tokenizer, tmp_path, capsys):
    """It used to load unverified (flipped bytes included) with only a warning;
    a lost manifest cannot be told from a conversion older than manifests, so it is refused
    by --load and by the converter alike (both resolve it with select_model_checkpoint)."""
    from loggra_megatron.checkpointing.layout import select_model_checkpoint

    converted = tmp_path / "converted"
    _converted_model(converted, tokenizer)
    select_model_checkpoint(converted)  # complete: accepted
    (converted / "release" / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="has no manifest.json, so its files cannot"):
        select_model_checkpoint(converted)
    refused(
        tiny_argv(tokenizer, load=converted, save=tmp_path / "run"),
        capsys,
        "has no manifest.json",
        "--direction hf-to-megatron",
    )
