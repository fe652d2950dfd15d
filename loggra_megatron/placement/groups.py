"""Which role this process plays in the torchrun world, and its process groups.

With ``--generation-ranks N`` the world of ``W`` ranks splits in two, each with a default
process group (and so a Megatron parallel state) of its own:

* the **training world**, ranks ``0 … W−N−1``: Megatron's TP/PP/DP grid, the optimizer,
  the checkpoint; its rank 0 is the **training leader**;
* the **generation world**, ranks ``W−N … W−1``: the policy at
  ``--generation-tensor-model-parallel-size``, its replicas splitting the rollout; its
  rank 0 (global rank ``W−N``) is the **generation leader**.

Both are made from torchrun's one rendezvous store, under prefixes of their own, so neither
sees the other's collectives. The two leaders share a third, two-rank gloo group: the
**channel** (``placement.channel``) that carries prompts, rollouts and weights. Everything
else in a world reaches its leader by that world's own collectives. Nothing in ``rollout/``
or ``train/`` below the trainer knows which placement it runs under.
"""

from __future__ import annotations

import datetime
import enum
import os
from dataclasses import dataclass

import torch.distributed as dist


class Role(enum.Enum):
    TRAINING = "training"
    GENERATION = "generation"


@dataclass(frozen=True)
class Placement:
    """This process's place: its role, its rank and size in that role's world, and its
    global rank in torchrun's world."""

    role: Role
    rank: int
    size: int
    global_rank: int
    training_size: int
    """Ranks that train (the generation world follows them)."""
    world_size: int
    """torchrun's world: both roles."""

    @classmethod
    def of(cls, generation_ranks: int, env=os.environ) -> Placement:
        world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
        training = world - generation_ranks
        if rank < training:
            return cls(Role.TRAINING, rank, training, rank, training, world)
        return cls(Role.GENERATION, rank - training, generation_ranks, rank, training, world)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def name(self) -> str:
        """``training rank 0`` … as messages name a rank (with its global rank)."""
        return f"{self.role.value} rank {self.rank} (global rank {self.global_rank})"

    def peer_leader_name(self) -> str:
        """The other world's leader, as messages name it."""
        if self.role is Role.TRAINING:
            return f"the generation leader (global rank {self.training_size})"
        return "the training leader (global rank 0)"


ROLE_WORLD_TIMEOUT_S = 30 * 60
"""The collectives' timeout within a role's world (torch's default): a world's ranks wait for
their leader, which waits at most ``--generation-timeout-minutes`` for the other side."""


def init_role_world(placement: Placement, backend: str, channel_timeout_s: float):
    """The default process group of this process's role (from torchrun's rendezvous store,
    under the role's prefix); returns the store the channel is made from."""
    timeout_s = max(ROLE_WORLD_TIMEOUT_S, 2 * channel_timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    p = placement
    store, _, _ = next(dist.rendezvous("env://", p.global_rank, p.world_size, timeout=timeout))
    role_store = dist.PrefixStore(f"loggra/{p.role.value}", store)
    dist.init_process_group(
        backend, store=role_store, rank=p.rank, world_size=p.size, timeout=timeout
    )
    return store


def channel_group(placement: Placement, store, timeout_s: float):
    """The two-rank gloo group of the leaders (the training leader is its rank 0); None on
    every other rank."""
    if not placement.leader:
        return None
    rank = 0 if placement.role is Role.TRAINING else 1
    return dist.ProcessGroupGloo(
        dist.PrefixStore("loggra/channel", store),
        rank,
        2,
        datetime.timedelta(seconds=timeout_s),
    )


def start_placement(placement: Placement, use_cuda: bool, timeout_s: float):
    """The role's world (before Megatron's parallel state, which then covers that world
    only) and, on a leader, its end of the channel (None elsewhere)."""
    from loggra_megatron.cpu import enable_cpu_megatron
    from loggra_megatron.placement.channel import Channel

    if use_cuda:
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        enable_cpu_megatron()
    store = init_role_world(placement, "nccl" if use_cuda else "gloo", timeout_s)
    group = channel_group(placement, store, timeout_s)
    return None if group is None else Channel(group, placement.peer_leader_name())
