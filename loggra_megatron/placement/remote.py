"""The trainer's side of generation on ranks of its own: an engine that sends each DP rank's
prompts to the generation ranks and the weights after every committed update.

``RemoteEngine`` stands in for the ``--rollout-engine`` in ``rl.experience`` (the same
``sync_weights`` / ``generate`` calls, and the engine's own answers about π_old), so the
experience, the actor and the loop run unchanged. Every call is collective over the training
world: the training leader talks to the generation leader over the channel and shares the
answer with its world, one failure included (every training rank then ends with the same
message, naming the generation side).

The weights the generation ranks sample with are the trainer's weights after its last
committed update: right before a request is sent (``generate``, or ``submit`` ahead of
training with ``--max-policy-lag``), the weights go first when an update was committed since
the last sync (``placement.weight_sender``: in full, or as the backward sketch's row updates).
A trial of predicted-KL control that is not committed leaves the weights, and so their
version, as they were. Each reply names the version that generated it
(``rollout/policy_lag``).
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from loggra_megatron.placement.channel import (
    Channel,
    Generate,
    GenerationStopped,
    PeerLost,
    Rollouts,
    Stop,
    rollout_on,
)
from loggra_megatron.placement.weight_sender import WeightSender

__all__ = ["RemoteEngine", "generate_remotely"]


class RemoteEngine:
    """The ``--rollout-engine`` run on the generation ranks (``engine``: the one they run,
    chosen for the same policy)."""

    def __init__(
        self,
        engine,
        channel: Channel | None,
        sender: WeightSender,
        placement_cfg,
        weights_version,
        gather_weights,
    ):
        self.engine, self.channel, self.sender = engine, channel, sender
        self.cfg = placement_cfg
        self.weights_version = weights_version
        """``() -> int``: the version of the trainer's weights (its RL steps done: weights
        change only in a step's update)."""
        self.gather_weights = gather_weights
        """``() -> None``: make every rank's model weights the committed ones (collective;
        the optimizer may leave their all-gather to the next forward)."""
        self.synced_version: int | None = None
        self.syncs = 0
        self.last_sync: dict[str, float] = {}
        self.policy = None
        self.in_flight: dict[object, int] = {}
        """Requests sent ahead (``submit``) by request, their ids."""
        self.replies: dict[int, Rollouts] = {}
        """Replies received while waiting for another, by request id (the leader's)."""
        self.next_id = 0
        self.stop_requested = False
        """A generation rank was signalled (SIGTERM, SIGINT): the run's agreed save-and-exit
        (the same on every training rank: it comes with a reply)."""
        self.name = engine.name
        self.recomputes_log_probs = engine.recomputes_log_probs

    def old_log_probs(self, apart: bool, on_policy: bool) -> str:
        return self.engine.old_log_probs(apart, on_policy)

    def sync_weights(self, policy) -> None:
        """Noted: the weights are sent right before the next request that needs them."""
        self.policy = policy

    def _sync_if_stale(self) -> None:
        """Send the weights if an update was committed since the last sync (collective)."""
        version = self.weights_version()
        if version == self.synced_version:
            return
        t0 = time.perf_counter()
        self.gather_weights()
        check = self._check_due() or self.sender.full_next and self.syncs > 0  # a resync
        sent, failure = self.sender.send(self.policy, version, check=check)
        _share_failure(failure)
        self.synced_version, self.syncs = version, self.syncs + 1
        self.last_sync = {"sync/bytes": float(sent), "sync/seconds": time.perf_counter() - t0}

    def _check_due(self) -> bool:
        return self.syncs % self.cfg.weight_sync_check_interval == 0

    def submit(self, policy, prompts: list[list[int]], request) -> None:
        """Send this DP rank's ``prompts`` ahead, with the current weights (collective); a
        later ``generate`` of the same request receives the rollout."""
        self.policy = policy
        self.in_flight[request] = self._send(prompts, request)

    def generate(self, policy, prompts: list[list[int]], request):
        """This DP rank's rollout of ``prompts``, made on the generation ranks: the one sent
        ahead for ``request``, else sent now (collective)."""
        from megatron.core import parallel_state as ps

        self.policy = policy
        request_id = self.in_flight.pop(request, None)
        if request_id is None:
            request_id = self._send(prompts, request)
        reply, timing = self._answer(request_id, request.step)
        while reply.resync:  # the checksum failed there: a full sync, and the request again
            self.synced_version, self.sender.full_next = None, True
            reply, timing = self._answer(self._send(prompts, request), request.step)
            timing["sync/checksum_ok"] = 0.0
        self.stop_requested |= reply.stop_requested
        rollout, stats = reply.rollouts[ps.get_data_parallel_rank()]
        stats = {**stats, **reply.stats, **timing, **self.last_sync}
        self.last_sync = {"sync/bytes": 0.0, "sync/seconds": 0.0}
        return rollout_on(rollout, next(policy.parameters()).device), stats

    def _answer(self, request_id: int, step: int) -> tuple[Rollouts, dict[str, float]]:
        """The reply to ``request_id`` on every training rank (collective), and the
        trainer's timing of it."""
        answer = [None]
        if self.channel is not None:
            t0 = time.perf_counter()
            try:
                reply = self._receive(request_id)
                answer = [(reply, _timing(reply, step, time.perf_counter() - t0))]
            except PeerLost as e:
                answer = [Stop(str(e))]
        dist.broadcast_object_list(answer, src=0)
        if isinstance(answer[0], Stop):
            raise _stopped(answer[0].reason)
        return answer[0]

    def _send(self, prompts, request) -> int:
        """Every DP rank's prompts to the leader, and from it a ``Generate`` after the
        weights it needs (collective); the request's id."""
        from megatron.core import parallel_state as ps

        self._sync_if_stale()
        request_id, self.next_id = self.next_id, self.next_id + 1
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((ps.get_data_parallel_rank(), prompts), gathered, dst=0)
        failure = None
        if self.channel is not None:
            shards = dict(gathered)
            try:
                self.channel.send(
                    Generate(request_id, request, [shards[j] for j in range(len(shards))])
                )
            except PeerLost as e:
                failure = str(e)
        _share_failure(failure)
        return request_id

    def _receive(self, request_id: int) -> Rollouts:
        """The leader's reply to ``request_id``, keeping the others that come first."""
        while request_id not in self.replies:
            reply = self.channel.recv()
            self.replies[reply.request_id] = reply
        return self.replies.pop(request_id)

    def stop(self, reason: str | None = None) -> None:
        """Tell the generation ranks the run ends (the leader; a lost peer is not waited
        for)."""
        if self.channel is not None:
            with contextlib.suppress(PeerLost):
                if reason is None:  # the replies in flight first: they are being sent
                    for request_id in self.in_flight.values():
                        self._receive(request_id)
                self.channel.send(Stop(reason))


def _timing(reply: Rollouts, step: int, waited: float) -> dict[str, float]:
    """The lag of the reply's rollouts (RL steps between the weights that generated them and
    the step that trains on them), the trainer's wait, and the share of the generation time
    it did not wait for."""
    hidden = 1.0 - min(waited, reply.seconds) / reply.seconds if reply.seconds > 0 else 0.0
    return {
        "rollout/policy_lag": float(step - reply.version),
        "time/training_idle_s": waited,
        "time/generation_hidden_fraction": hidden,
    }


def _share_failure(failure: str | None) -> None:
    """Every training rank learns the leader's failure (collective); raises it."""
    box = [failure]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise _stopped(box[0])


def _stopped(reason: str) -> GenerationStopped:
    return GenerationStopped(f"generation ranks: {reason}")


def generate_remotely(experience, stepper, channel, model_args, cfg, weights_version):
    """Puts a ``RemoteEngine`` in place of ``experience``'s engine (``cfg``: the run's
    ``RunConfig``); returns it and the line to print. The generation ranks sample with the
    weights of the last RL step, gathered first where the optimizer leaves that to the next
    forward (``stepper``: the trainer's ``MegatronStepper``)."""

    def gather_weights() -> None:
        if not stepper.commit_syncs_weights:
            stepper.finish_weight_sync()  # the commit's gathers, not a new one

    sender = WeightSender(channel, model_args, cfg.placement, stepper.optimizer)
    remote = RemoteEngine(
        experience.engine, channel, sender, cfg.placement, weights_version, gather_weights
    )
    experience.engine = remote
    gen_tp = cfg.placement.generation_tp(cfg.parallel.tensor_model_parallel_size)
    note = (
        f" placement: {cfg.placement.generation_ranks} generation ranks (TP {gen_tp}), "
        f"{cfg.training_world_size} training ranks"
    )
    return remote, note
