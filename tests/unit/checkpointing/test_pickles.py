"""A checkpoint's pickles are read through an allowlist before the storage layer reads them:
a crafted ``.metadata``, ``common.pt`` or sharded object is refused in one line naming the
file and the class, and nothing of it runs; what torch.distributed.checkpoint writes passes."""

import contextlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crafted_pickles import OPEN, Opens

from loggra_megatron.checkpointing.pickles import UnsafeCheckpointError, check_pickles


def _saved(path):
    """A dist checkpoint with a tensor, a sharded object (``extra.*``) and ``common.pt``."""
    state = {"weight": torch.arange(6.0).view(2, 3), "extra": {"step": 3, "name": "x"}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"step": 3, "rng": torch.zeros(4)}, path / "common.pt")
    return path


def _unchecked(read) -> None:
    """``read()`` as the storage layer does it, whatever it makes of the crafted object."""
    with contextlib.suppress(Exception):  # the crafted object is no data: it ran before
        read()


def _refused(path, *needles):
    with pytest.raises(UnsafeCheckpointError) as e:
        check_pickles(str(path))
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_what_torch_distributed_checkpoint_writes_passes(tmp_path):
    check_pickles(str(_saved(tmp_path / "ckpt")))


def test_a_crafted_metadata_is_refused_and_never_run(tmp_path):
    """The storage layer's own reader runs it (unpickling the metadata); the check refuses it
    first, naming the file and the class."""
    path = _saved(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Opens(marker)))
    _refused(path, f"{path}/.metadata", f"its pickle names {OPEN}", "nothing of it was run")
    assert not marker.exists()
    _unchecked(lambda: dcp.FileSystemReader(str(path)).read_metadata())
    assert marker.exists()  # what reading it without the check did


def test_a_crafted_or_garbled_common_pt_is_refused_in_one_line(tmp_path):
    path = _saved(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    torch.save({"step": 3, "evil": Opens(marker)}, path / "common.pt")
    _refused(path, f"{path}/common.pt", OPEN)
    assert not marker.exists()
    (path / "common.pt").write_bytes(b"\x80\x04garbage")
    _refused(path, f"{path}/common.pt", "not a readable checkpoint file (BadZipFile")


def test_a_crafted_sharded_object_is_refused_and_never_run(tmp_path):
    """torch.distributed.checkpoint loads sharded objects (``.distcp`` items) without
    ``weights_only``: one pointed at a crafted archive ran on load."""
    path = _saved(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    (index,) = [i for i in metadata.storage_data if i.fqn == "extra.step"]
    info = metadata.storage_data[index]
    data = path / info.relative_path
    with open(data, "ab") as f:
        offset = f.tell()
        torch.save(Opens(marker), f)
        info.offset, info.length = offset, f.tell() - offset
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _refused(path, f"{data} (item extra.step)", OPEN)
    assert not marker.exists()
    request = {"extra": {"step": 0, "name": ""}}
    _unchecked(lambda: dcp.load(request, checkpoint_id=str(path), no_dist=True))
    assert marker.exists()  # what loading it without the check did
