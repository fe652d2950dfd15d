"""The channel between the training leader and the generation leader: Python messages
(pickled into a byte tensor, length first) and tensors, over their two-rank gloo group
(``placement.groups.channel_group``).

A peer that dies closes its sockets, which fails the pending send or receive at once; a peer
that hangs fails it after ``--generation-timeout-minutes``. Either way ``PeerLost`` names
the peer, and the leader passes the failure on to its world so that every rank ends with the
same message (``placement.remote``, ``placement.worker``).
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import torch

__all__ = [
    "Bucket",
    "Channel",
    "Generate",
    "GenerationStopped",
    "PeerLost",
    "Rollouts",
    "Stop",
    "Weights",
    "WeightsEnd",
    "rollout_on",
]


class PeerLost(RuntimeError):
    """The other leader died, hung past the timeout, or reported a failure."""


class GenerationStopped(RuntimeError):
    """The run cannot go on for a failure across the two roles (raised on every rank of a
    role alike, with the same message)."""


@dataclass
class Generate:
    """Generate ``shards[j]`` (training DP rank ``j``'s prompts) with ``request``; the reply
    carries ``request_id``."""

    request_id: int
    request: object
    shards: list[list[list[int]]]


@dataclass
class Weights:
    """A full weight sync of the trainer's weights after ``version`` updates follows: one
    ``Bucket`` (and its bytes) after another, then ``WeightsEnd``."""

    version: int


@dataclass
class Bucket:
    """The bytes of these tensors follow (``placement.weights.pack_buckets``)."""

    specs: list
    nbytes: int


@dataclass
class WeightsEnd:
    """The sync's last message: the trainer's digest of all its weights, when a checksum is
    due (None: not this time); with ``--weight-sync lowrank``, the masters of the sketched
    weights (the first sync: ``row_masters``) or the row updates committed since the last
    sync (``row_updates``; the buckets then held the other trained weights only)."""

    digest: str | None
    row_masters: list | None = None
    row_updates: list | None = None


@dataclass
class Rollouts:
    """The reply to ``Generate`` ``request_id``: one ``(rollout, stats)`` per shard (CPU
    tensors), the version of the weights that generated them (the trainer's RL steps done
    at their sync), the seconds the generation took, and the generation side's numbers
    (``stats``: ``metric_keys``)."""

    request_id: int
    rollouts: list
    version: int
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)
    stop_requested: bool = False
    """SIGTERM or SIGINT reached a generation rank: the trainer saves and exits at its next
    step boundary, as for a signal on one of its own ranks."""
    resync: bool = False
    """The generation ranks' weights failed their checksum (``--weight-sync-on-mismatch
    resync``): no rollout was made; the trainer sends a full sync and the request again."""


@dataclass
class Stop:
    """The run ends (``reason`` None: normally); from the generation side, a failure."""

    reason: str | None = None


class Channel:
    """One leader's end of the channel: ``send``/``recv`` of messages, ``send_tensor`` /
    ``recv_tensor`` of flat tensors (CPU: gloo)."""

    def __init__(self, group, peer_name: str):
        self.group, self.peer_name = group, peer_name
        self.peer = 1 - group.rank()
        self.bytes_sent = 0
        """Bytes this end has sent (messages and tensors)."""

    def send(self, message) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self._send(torch.tensor([payload.numel()], dtype=torch.int64))
        self._send(payload)

    def recv(self):
        size = torch.empty(1, dtype=torch.int64)
        self._recv(size)
        payload = torch.empty(int(size), dtype=torch.uint8)
        self._recv(payload)
        message = pickle.loads(payload.numpy().tobytes())
        if isinstance(message, Stop) and message.reason is not None:
            raise PeerLost(f"{self.peer_name} stopped the run: {message.reason}")
        return message

    def send_tensor(self, tensor: torch.Tensor) -> None:
        self._send(tensor.detach().contiguous().cpu())

    def recv_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        self._recv(out)
        return out

    def _send(self, tensor: torch.Tensor) -> None:
        try:
            self.group.send([tensor], self.peer, 0).wait()
        except RuntimeError as e:
            raise PeerLost(
                f"{self.peer_name} did not take the data ({_first_line(e)}): it died, or hung "
                "past --generation-timeout-minutes"
            ) from None
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _recv(self, tensor: torch.Tensor) -> None:
        try:
            self.group.recv([tensor], self.peer, 0).wait()
        except RuntimeError as e:
            raise PeerLost(
                f"{self.peer_name} did not answer ({_first_line(e)}): it died, or hung past "
                "--generation-timeout-minutes"
            ) from None


def rollout_on(rollout, device):
    """``rollout`` (a ``rollout.Rollout``) with its tensors on ``device``."""
    moved = {
        f.name: getattr(rollout, f.name).to(device)
        for f in dataclasses.fields(rollout)
        if isinstance(getattr(rollout, f.name), torch.Tensor)
    }
    return dataclasses.replace(rollout, **moved)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
