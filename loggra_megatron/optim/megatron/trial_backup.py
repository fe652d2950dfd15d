"""The copy of the model weights that a predicted-KL trial overwrites and nothing else keeps.

A trial (``MegatronStepper.try_candidate``) writes ``θ + η·Δθ`` into the model weights
while the fp32 masters keep θ. Where a master *is* its model weight (fp32 models, refused
for KL control) or half of it (``--loggra-param-remainders``: the master is the bf16 weight
plus an int16 remainder), θ's weights would be lost, so this rank's shards of them are
copied before the first trial of an optimizer step and written back after each trial:
2 bytes per such master element.

The copy lives on the device (``on_host=False``) or, with ``--kl-backup-offload``, in
host memory: pinned buffers allocated once and reused every step, filled by one
device-to-host copy per optimizer step and read by one host-to-device copy per trial, both
ordered on the current stream (``non_blocking`` into and out of pinned memory). The
device then holds none of it.
"""

from __future__ import annotations

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TrialBackup:
    """θ's values of ``tensors`` across the trials of one optimizer step."""

    def __init__(self, tensors: list[torch.Tensor], on_host: bool):
        self.tensors = tensors
        self.on_host = on_host
        self._copies: list[torch.Tensor] | None = None
        self.valid = False
        """Whether the copies hold this step's θ (reset by ``invalidate``)."""
        self.snapshots = 0
        """How many times θ was copied (once per optimizer step that tries a candidate)."""

    @property
    def device_bytes(self) -> int:
        """Device memory the copies hold while valid (0 on the host)."""
        if self.on_host or not self.valid:
            return 0
        return sum(map(_nbytes, self.tensors))

    @property
    def host_bytes(self) -> int:
        """Host memory the copies hold (kept between steps with ``on_host``)."""
        return sum(map(_nbytes, self._copies)) if self.on_host and self._copies else 0

    @torch.no_grad()
    def take(self) -> None:
        """Copy θ, unless this step's copy is already held."""
        if self.valid:
            return
        if self.on_host:
            if self._copies is None:
                self._copies = [self._host_buffer(t) for t in self.tensors]
            for copy, t in zip(self._copies, self.tensors, strict=True):
                copy.copy_(t, non_blocking=copy.is_pinned())
        else:
            self._copies = [t.detach().clone() for t in self.tensors]
        self.valid = True
        self.snapshots += 1

    @torch.no_grad()
    def restore(self) -> None:
        """Write θ back into the tensors (after a trial)."""
        for t, copy in zip(self.tensors, self._copies or [], strict=True):
            t.copy_(copy, non_blocking=copy.is_pinned())

    def invalidate(self) -> None:
        """The step is over (committed, rejected, or a new one prepared): device copies are
        freed; host buffers are kept for the next step."""
        self.valid = False
        if not self.on_host:
            self._copies = None

    @staticmethod
    def _host_buffer(t: torch.Tensor) -> torch.Tensor:
        pin = t.is_cuda and torch.cuda.is_available()
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
