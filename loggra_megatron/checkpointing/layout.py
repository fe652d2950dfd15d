"""On-disk layout of trainer checkpoints, and which iteration a ``--load`` resumes.

A checkpoint root (``--save DIR``), Megatron-LM's layout::

    DIR/latest_checkpointed_iteration.txt   the iteration to resume ("release": a converted
                                            model, see loggra_megatron.convert.checkpoint)
    DIR/iter_0000100/                       one torch_dist checkpoint of iteration 100
        run_config.json                     the run's settings (read before any process starts)
        manifest.json                       written last: every file's size and CRC-32
    DIR/loggra_model_args.json              the architecture (for tools/convert_checkpoint.py)

Saving (:mod:`loggra_megatron.checkpointing.dist_ckpt`) writes ``iter_N.tmp``; a directory
is *complete* once its manifest exists, since the manifest is written last. A new iteration
is renamed into place and the tracker replaced after it. Re-saving an existing iteration
renames the old one to ``iter_N.old`` first, so a crash between the two renames leaves the
complete ``iter_N.tmp`` (new) and ``iter_N.old`` (previous) but no ``iter_N``.

:func:`select_checkpoint` therefore resumes the tracked iteration if its directory is
complete, and otherwise falls back, with a warning, to the newest complete directory:
``iter_N``, then a complete ``iter_N.tmp``, then ``iter_N.old``. Nothing here needs a
process group: ``pretrain_rl.py`` resolves ``--load`` before it starts one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
RUN_CONFIG = "run_config.json"
MODEL_ARGS = "loggra_model_args.json"
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
    with open(path) as f:
        return f.read().strip()


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker points to, or None if there is no trainer checkpoint."""
    text = read_tracker(root)
    return int(text) if text is not None and text.isdigit() else None


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new file whole."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: str) -> dict | None:
    """The manifest of checkpoint directory ``path``, or None if it is incomplete/unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "files" in manifest else None


def manifest_problem(path: str, manifest: dict) -> str | None:
    """What is missing or truncated in ``path`` according to its manifest (sizes only)."""
    for rel, entry in manifest["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != entry["bytes"]:
            return f"{rel} has {os.path.getsize(full)} bytes, the manifest says {entry['bytes']}"
    return None


@dataclass
class CheckpointRef:
    """A complete checkpoint directory chosen for loading."""

    root: str
    iteration: int
    path: str
    warnings: list[str] = field(default_factory=list)
    """Why the tracked iteration was not used (printed by the caller)."""

    def run_config(self) -> dict | None:
        """The run's settings saved with it (None for checkpoints older than that file)."""
        try:
            with open(os.path.join(self.path, RUN_CONFIG)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None


def _complete(path: str) -> str | None:
    """None if ``path`` is a complete, size-consistent checkpoint, else why not."""
    if not os.path.isdir(path):
        return "is missing"
    manifest = read_manifest(path)
    if manifest is None:
        legacy = os.path.isfile(os.path.join(path, "metadata.json")) and not path.endswith(
            (".tmp", ".old")
        )
        return None if legacy else f"has no readable {MANIFEST} (an interrupted save)"
    problem = manifest_problem(path, manifest)
    return None if problem is None else f"is damaged: {problem}"


def candidates(root: str) -> list[tuple[int, str]]:
    """``(iteration, path)`` of every iteration directory under ``root``, newest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _DIR_RE.match(name)
        if m:
            found.append((int(m.group(1)), _PREFERENCE[m.group(2) or ""], name))
    found.sort(key=lambda t: (-t[0], t[1]))
    return [(it, os.path.join(root, name)) for it, _, name in found]


def has_checkpoint(root: str) -> bool:
    """Whether ``root`` holds a trainer checkpoint (a numeric tracker or an iteration dir)."""
    return latest_iteration(root) is not None or bool(candidates(root))


def select_checkpoint(root: str, iteration: int | None = None) -> CheckpointRef:
    """The checkpoint to load from ``root``: ``iteration`` if given (it must be complete),
    else the tracked one, falling back to the newest complete one with a warning.
    Raises ``FileNotFoundError`` when there is none."""
    if iteration is not None:
        path = checkpoint_dir(root, iteration)
        problem = _complete(path)
        if problem is not None:
            raise FileNotFoundError(f"checkpoint {path} {problem}")
        return CheckpointRef(root, iteration, path)
    tracked = latest_iteration(root)
    warnings = []
    if tracked is not None:
        path = checkpoint_dir(root, tracked)
        problem = _complete(path)
        if problem is None:
            return CheckpointRef(root, tracked, path)
        warnings.append(f"the tracked iteration {tracked} ({path}) {problem}")
    for it, path in candidates(root):
        problem = _complete(path)
        if problem is None:
            if tracked is None:
                warnings.append(f"{root} has no {TRACKER}")
            warnings.append(f"falling back to the newest complete checkpoint {path}")
            return CheckpointRef(root, it, path, warnings)
        if tracked is None or path != checkpoint_dir(root, tracked):
            warnings.append(f"{path} {problem}")
    why = "; ".join(warnings) or f"no {TRACKER} and no iter_* directory"
    raise FileNotFoundError(f"no complete checkpoint under {root!r}: {why}")
