"""On-disk layout of trainer checkpoints, and which iteration a ``--load`` resumes.

A checkpoint root (``--save DIR``) has Megatron-LM's layout: the tracker
``latest_checkpointed_iteration.txt``, one ``torch_dist`` directory ``iter_NNNNNNN`` per
saved iteration with its ``run_config.json`` and a ``manifest.json`` written last (every
file's size and CRC-32), and ``loggra_model_args.json`` (the architecture). A directory is
*complete* when its manifest is valid and describes it. ``select_checkpoint`` resumes
the tracked iteration if its directory is complete, and otherwise falls back, with a
warning, to the newest complete directory: ``iter_N``, then a complete ``iter_N.tmp``, then
``iter_N.old``. An incomplete ``iter_N.tmp`` is an *interrupted save*, removed when the
next run claims the directory. Nothing here needs a process group: ``pretrain_rl.py``
resolves ``--load`` before it starts one.

The layout, completeness, and why every crash point leaves a complete checkpoint:
docs/checkpointing.md#layout and docs/checkpointing.md#what-counts-as-complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass, field

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
RUN_CONFIG = "run_config.json"
MODEL_ARGS = "loggra_model_args.json"
RELEASE = "release"
"""The iteration directory (and tracker text) of a converted model."""
CHECKED_AT_SELECTION = (RUN_CONFIG,)
"""Small files whose CRC-32 is checked when a checkpoint is selected (before any process
group); the others are verified by the loading ranks."""
_DIR_RE = re.compile(r"^iter_(\d{7,})(\.tmp|\.old)?$")
_PREFERENCE = {"": 0, ".tmp": 1, ".old": 2}  # same iteration: final, then new, then previous


class CheckpointError(RuntimeError):
    """A checkpoint was refused (on every rank alike); nothing was written or loaded."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> str | None:
    """The tracker's text (an iteration number or ``release``), or None without one."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        return f.read().strip()


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker points to, or None if there is no trainer checkpoint."""
    text = read_tracker(root)
    return int(text) if text is not None and text.isdigit() else None


def tracker_note(root: str) -> str:
    """What the tracker of ``root`` says, for messages about a missing iteration."""
    text = read_tracker(root)
    if text is None:
        return f"no {TRACKER}"
    return f"{TRACKER} holds {text[:40]!r}, not an iteration number"


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new file whole."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _manifest_schema_problem(manifest) -> str | None:
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return "lists no files"
    for rel, entry in files.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and entry["bytes"] >= 0
        if not ok or not isinstance(entry.get("crc32", 0), int):
            return f"has a malformed entry for {rel!r}: {entry!r}"
    return None


def _load_manifest(path: str) -> tuple[dict | None, str | None]:
    """``(manifest, None)``, or ``(None, why it cannot be used)``."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        return None, f"has no readable {MANIFEST} (it is missing: an interrupted save)"
    except (OSError, ValueError) as e:
        return None, f"has no readable {MANIFEST} ({type(e).__name__}: {e})"
    problem = _manifest_schema_problem(manifest)
    return (None, f"has no readable {MANIFEST} (it {problem})") if problem else (manifest, None)


def read_manifest(path: str) -> dict | None:
    """The valid manifest of checkpoint directory ``path``, or None."""
    return _load_manifest(path)[0]


def list_files(path: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """Every file under ``path`` (relative, sorted), except the names in ``exclude``."""
    out = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel not in exclude:
                out.append(rel)
    return sorted(out)


def file_crc32(path: str, chunk: int = 16 * 2**20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(chunk):
            crc = zlib.crc32(data, crc)
    return crc


def _saved_with_checksums(path: str) -> bool:
    """Whether the run that saved ``path`` asked for CRC-32s (its ``run_config.json``)."""
    try:
        with open(os.path.join(path, RUN_CONFIG), "rb") as f:
            flags = json.loads(f.read()).get("flags")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(flags, dict) and flags.get("checkpoint_checksums") is True


def _checksum_gap(path: str, files: dict) -> str | None:
    """A save records the CRC-32 of every file, or of none (``--no-checkpoint-checksums``):
    a file without one among files with one, or none where the saving run asked for them,
    is a damaged manifest (its damaged bytes would load unchecked)."""
    unchecked = sorted(rel for rel, entry in files.items() if "crc32" not in entry)
    if unchecked and len(unchecked) < len(files):
        return f"{unchecked[0]} has no CRC-32 in {MANIFEST}, unlike the other files"
    if unchecked and _saved_with_checksums(path):
        return f"{MANIFEST} lists no CRC-32, though its run saved with checksums"
    return None


def manifest_problem(path: str, manifest: dict) -> str | None:
    """What in ``path`` disagrees with its manifest: a file missing, unlisted or of another
    size, a small file (``CHECKED_AT_SELECTION``) failing its CRC-32, or a CRC-32 missing
    (``_checksum_gap``)."""
    files = manifest["files"]
    gap = _checksum_gap(path, files)
    if gap is not None:
        return gap
    unlisted = sorted(set(list_files(path, exclude=(MANIFEST,))) - set(files))
    if unlisted:
        return f"{unlisted[0]} is not in the manifest"
    for rel, entry in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != entry["bytes"]:
            return f"{rel} has {os.path.getsize(full)} bytes, the manifest says {entry['bytes']}"
        if rel in CHECKED_AT_SELECTION and "crc32" in entry and file_crc32(full) != entry["crc32"]:
            return f"{rel} fails its CRC-32 check"
    return None


def checkpoint_problem(path: str) -> str | None:
    """None if ``path`` is a complete checkpoint directory (see the module docstring), else
    why not."""
    if not os.path.isdir(path):
        return "is missing"
    manifest, why = _load_manifest(path)
    if manifest is None:
        return why
    problem = manifest_problem(path, manifest)
    return None if problem is None else f"is damaged: {problem}"


@dataclass
class CheckpointRef:
    """A complete checkpoint directory chosen for loading."""

    root: str
    iteration: int | None
    """The iteration (None: a converted model's ``release``)."""
    path: str
    warnings: list[str] = field(default_factory=list)
    """Why the tracked iteration was not used (printed by the caller)."""
    pinned: bool = False
    """Asked for by number (``--ckpt-step``): never replaced by an older one."""

    def run_config(self) -> dict | None:
        """The run's settings saved with it (None for checkpoints older than that file).
        Raises ``ValueError`` naming the file if it is not readable."""
        path = os.path.join(self.path, RUN_CONFIG)
        try:
            with open(path, "rb") as f:
                saved = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not readable ({type(e).__name__}: {e})") from None
        if not isinstance(saved, dict) or not isinstance(saved.get("flags"), dict):
            raise ValueError(f"{path} is not a run configuration (no 'flags' object)")
        return saved


def candidates(root: str) -> list[tuple[int, str]]:
    """``(iteration, path)`` of every iteration directory under ``root``, newest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _DIR_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), _PREFERENCE[m.group(2) or ""], name))
    found.sort(key=lambda t: (-t[0], t[1]))
    return [(it, os.path.join(root, name)) for it, _, name in found]


def interrupted_saves(root: str) -> list[str]:
    """The ``iter_N.tmp`` directories under ``root`` that are not complete: saves that were
    interrupted before their manifest was written (or damaged since)."""
    return [p for _, p in candidates(root) if p.endswith(".tmp") and checkpoint_problem(p)]


def remove_interrupted_saves(root: str) -> list[str]:
    """Remove ``interrupted_saves`` (their space is reclaimed); the paths removed. Only
    for the run that holds ``root``'s run lock."""
    removed = interrupted_saves(root)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def has_checkpoint(root: str) -> bool:
    """Whether ``root`` holds a trainer checkpoint: a numeric tracker, or an iteration
    directory that is not an interrupted save."""
    if latest_iteration(root) is not None:
        return True
    interrupted = set(interrupted_saves(root))
    return any(path not in interrupted for _, path in candidates(root))


def holds_converted_model(root: str) -> bool:
    """Whether ``root`` holds a model from ``tools/convert_checkpoint.py`` (``release``)."""
    return read_tracker(root) == RELEASE or os.path.isdir(os.path.join(root, RELEASE))


def select_checkpoint(root: str, iteration: int | None = None) -> CheckpointRef:
    """The checkpoint to load from ``root``: ``iteration`` if given (it must be complete),
    else the tracked one, falling back to the newest complete one with a warning.
    Raises ``FileNotFoundError`` when there is none."""
    if iteration is not None:
        path = checkpoint_dir(root, iteration)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise FileNotFoundError(f"checkpoint {path} {problem}")
        return CheckpointRef(root, iteration, path, pinned=True)
    tracked = latest_iteration(root)
    warnings = []
    if tracked is not None:
        path = checkpoint_dir(root, tracked)
        problem = checkpoint_problem(path)
        if problem is None:
            return CheckpointRef(root, tracked, path)
        warnings.append(f"the tracked iteration {tracked} ({path}) {problem}")
    else:
        warnings.append(f"{root} has {tracker_note(root)}")
    skip = checkpoint_dir(root, tracked) if tracked is not None else None
    ref = _newest_complete(root, candidates(root), warnings, skip)
    if ref is None:
        raise FileNotFoundError(f"no complete checkpoint under {root!r}: {'; '.join(warnings)}")
    return ref


def older_checkpoint(ref: CheckpointRef, why: str) -> CheckpointRef | None:
    """The newest complete checkpoint after ``ref`` in the fallback order (``why``: what is
    wrong with ``ref``), or None; never for a pinned ``ref``."""
    if ref.pinned or ref.iteration is None:
        return None
    order = candidates(ref.root)
    paths = [path for _, path in order]
    rest = order[paths.index(ref.path) + 1 :] if ref.path in paths else []
    return _newest_complete(ref.root, rest, [*ref.warnings, f"{ref.path} {why}"])


def _newest_complete(root, order, warnings: list[str], skip: str | None = None):
    for it, path in order:
        if path == skip:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            warnings.append(f"falling back to the newest complete checkpoint {path}")
            return CheckpointRef(root, it, path, warnings)
        warnings.append(f"{path} {problem}")
    return None


def select_model_checkpoint(
    load_dir: str | os.PathLike, iteration: int | None = None
) -> CheckpointRef:
    """The checkpoint of ``load_dir`` as ``pretrain_rl.py --load`` resolves it: a trainer
    checkpoint root (the tracked iteration, or ``iteration``; an incomplete one falls back
    to the newest complete one, with a warning), a converted model (``release``), or a dist
    checkpoint directory itself. Sizes are checked here (no process group); the CRC-32 when
    it is loaded (``verified_checkpoint``).
    Raises ``FileNotFoundError`` saying what is wrong."""
    load_dir = os.fspath(load_dir)
    if iteration is not None or has_checkpoint(load_dir):
        return select_checkpoint(load_dir, iteration)
    if holds_converted_model(load_dir):
        path = os.path.join(load_dir, RELEASE)
    elif os.path.isfile(os.path.join(load_dir, "metadata.json")):
        path = load_dir
    else:
        raise FileNotFoundError(
            f"{load_dir} holds no Megatron checkpoint ({tracker_note(load_dir)}, no complete "
            f"iter_* directory, no {RELEASE} directory, no metadata.json)"
        )
    ref = CheckpointRef(load_dir, None, path, pinned=True)
    lost = os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST))
    if path != load_dir and lost:
        # a lost manifest cannot be told from a conversion older than manifests: neither
        # can be verified, so neither is loaded (a flipped byte would train silently)
        raise FileNotFoundError(
            f"converted model {path} has no {MANIFEST}, so its files cannot be verified (it "
            "was lost, or the model was converted before manifests existed): convert the "
            "Hugging Face model again with tools/convert_checkpoint.py --direction "
            "hf-to-megatron"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise FileNotFoundError(f"checkpoint {path} {problem}")
    return ref


def resume_note(save: str | None) -> str:
    """Where a stopped run can resume from: the newest checkpoint in ``save`` (--save)."""
    iteration = None if save is None else latest_iteration(save)
    if save is None:
        return "no checkpoint was saved (--save is unset)"
    if iteration is None:
        return f"--save {save} holds no checkpoint yet"
    return (
        f"the last checkpoint is {checkpoint_dir(save, iteration)} (step {iteration}): "
        f"resume from it with --load {save}"
    )
