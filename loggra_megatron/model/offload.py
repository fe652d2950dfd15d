"""A frozen model's weights in host memory, streamed to the device unit by unit during its
forward passes (``--reference-offload``: the reference model of ``--kl-coef > 0``).

The reference model only runs forward-only passes (the reference log-probs of each RL step),
so a weight needs to be on the device only while the layer that reads it computes.
``offload_to_host`` keeps every parameter of a ``GPTModel`` stage in host memory (pinned
on CUDA, so the copies are asynchronous) and cuts the stage into *units*, in forward order::

    embedding (first stage) │ each TransformerLayer │ final norm + output layer (last stage;
                                                       with the embedding weight when tied)

Contract, in device bytes of the model's weights (``B_k``: the bytes of unit ``k``):

* while unit ``k`` computes: ``B_k + B_{k+1}`` (it and the prefetched next unit), so at
  most ``2·max_k B_k``: what the memory model counts for the reference log-prob phase;
* after a pass: on the last pipeline stage, the output unit ``B_last`` (final norm +
  output layer), kept until ``release_device_weights`` (the trainer calls it after the
  experience), the next pass or ``host_weights``: the log-prob head
  (``model.output_head``) reads the output weight after the model's
  forward has returned, in the schedule's loss function;
* after ``release_device_weights``: **0**. Every parameter's ``.data`` is an empty
  placeholder on the device (``named_parameters()``, ``.device`` and the state-dict names
  are unchanged).

Mechanism: a forward pre-hook on each unit's first module and a forward hook on the last
module of every unit but the output unit::

    pre-hook(k)   first unit of a pass: release what the last pass kept
                  stage k unless a prefetch did
                  the compute stream waits for ready[k]; param.data ← its staged copy
                  stage k+1: its device buffers allocated on the compute stream; the copy
                  stream waits for the compute stream, copies host → device (non-blocking)
                  and records the event ready[k+1]
    post-hook(k)  param.data ← the placeholder (unit k's device buffers are freed)

The copy of unit ``k+1`` thus overlaps unit ``k``'s compute. Every device buffer is
allocated and freed in the compute stream's order, and the copy stream writes it only
between waiting for the compute stream (so memory it reuses is done with) and ``ready``,
which the compute stream waits for before the buffer's first use: no ``record_stream``.

Cost: each forward call (each micro-batch of the forward-only schedule, on each pipeline
stage) copies all of the stage's weights host → device, ``Σ_k B_k`` bytes; it hides behind
compute while copying a unit at the host link's bandwidth takes less than the previous
unit's compute. The host holds ``Σ_k B_k`` pinned bytes per rank.

Writes and checkpoints go to the host copies: ``host_weights`` makes them the
parameters' data for a block (``RLTrainer._copy_policy_to_reference``), and the model's
``state_dict``, ``load_state_dict`` and ``sharded_state_dict`` (``dist_checkpointing``) run
inside it, the tensors they return being the host copies. A checkpoint holds the same
tensors with or without offload, and loads either way. A forward inside
``host_weights`` is not supported.

On CPU (device = host) the same code runs without streams or pinning: the host copies are
the parameters' original tensors and the parameters hold empty placeholders between
forwards, so tests can observe residency.

FP8 (Transformer Engine): given Megatron's ``is_first_microbatch``, TE keeps each linear
layer's FP8 weight (and its transpose) cached in the module between forwards, which would
keep an FP8 copy (1-2 bytes per weight) of the whole reference resident. The offload sets
``disable_parameter_transpose_cache`` on every module that reads it, so TE quantizes the
streamed weight at each forward and drops the FP8 copy with its other temporaries.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

OFFLOAD_ATTRIBUTE = "host_offload"
"""Attribute of an offloaded ``GPTModel`` that holds its ``HostOffload``."""


@dataclass(eq=False)
class _Unit:
    """Parameters streamed to the device together, and the device copies staged for them."""

    name: str
    params: list[torch.nn.Parameter]
    staged: list[torch.Tensor] | None = None
    """Device copies (in flight or installed), None while the unit is not resident."""
    ready: torch.cuda.Event | None = None
    """Recorded on the copy stream after the staged copies (CUDA)."""


def _unit_layout(gpt) -> list[tuple[str, torch.nn.Module, torch.nn.Module, list]]:
    """``(name, first module, last module, parameters)`` of each unit of a ``GPTModel``
    stage, in forward order."""
    units = []
    if gpt.pre_process:
        units.append(("embedding", gpt.embedding, gpt.embedding, list(gpt.embedding.parameters())))
    for layer in gpt.decoder.layers:
        units.append((f"layer {layer.layer_number}", layer, layer, list(layer.parameters())))
    if gpt.post_process:
        norm, output = gpt.decoder.final_layernorm, gpt.output_layer
        params = [*(norm.parameters() if norm is not None else ()), *output.parameters()]
        if gpt.share_embeddings_and_output_weights:  # the output layer reads this weight
            shared = gpt.shared_embedding_or_output_weight()
            if all(p is not shared for p in params):
                params.append(shared)
        units.append(("output", output if norm is None else norm, output, params))
    return units


def _detach_parameter(value):
    """``value`` with a parameter (or a ``ShardedTensor``'s parameter ``data``) replaced by a
    tensor of its current data, which outlives a later swap of the parameter's data."""
    if isinstance(value, torch.nn.Parameter):
        return value.detach()
    if isinstance(getattr(value, "data", None), torch.nn.Parameter):
        value.data = value.data.detach()
    return value


class HostOffload:
    """The host offload of one ``GPTModel`` stage (made by ``offload_to_host``)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from megatron.core.utils import unwrap_model

        gpt = unwrap_model(model)
        trainable = [name for name, p in gpt.named_parameters() if p.requires_grad]
        if trainable:
            raise ValueError(
                f"offload_to_host: {trainable[0]} requires grad; only a frozen model (forward "
                "passes without backward) can keep its weights on the host"
            )
        layout = _unit_layout(gpt)
        covered = {id(p) for *_, params in layout for p in params}
        missing = [name for name, p in gpt.named_parameters() if id(p) not in covered]
        if missing:
            raise ValueError(
                f"offload_to_host: {', '.join(missing)} belong to no unit (embedding, "
                "transformer layer, final norm + output layer)"
            )
        self.device = device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._params = list(gpt.parameters())
        self._placeholder = {
            dtype: torch.empty(0, dtype=dtype, device=device)
            for dtype in {p.dtype for p in self._params}
        }
        self._host = {}
        for p in self._params:
            self._host[id(p)] = self._host_copy(p.data)
            p.data = self._placeholder[p.dtype]
        self.units = [_Unit(name, params) for name, _, _, params in layout]
        for k, (_, first, last, _) in enumerate(layout):
            first.register_forward_pre_hook(functools.partial(self._before_unit, k))
            if not (gpt.post_process and k + 1 == len(layout)):  # output: read after it
                last.register_forward_hook(functools.partial(self._release, k), always_call=True)
        self._host_depth = 0
        for name in ("state_dict", "load_state_dict", "sharded_state_dict"):
            setattr(gpt, name, self._on_host(getattr(gpt, name)))
        for module in gpt.modules():  # TE's FP8 weight cache: see the module docstring
            if hasattr(module, "disable_parameter_transpose_cache"):
                module.disable_parameter_transpose_cache = True
        setattr(gpt, OFFLOAD_ATTRIBUTE, self)

    def _host_copy(self, data: torch.Tensor) -> torch.Tensor:
        if self._copy_stream is None:  # CPU: the original tensor is the host copy
            return data
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data)
        return host

    # ------------------------------------------------------------------ the forward
    def _before_unit(self, k: int, module, args) -> None:
        if k == 0:  # a pass starts: the last unit of the previous one (or of one cut short)
            self.release()
        self._stage(k)
        self._install(k)
        if k + 1 < len(self.units):
            self._stage(k + 1)

    def _stage(self, k: int) -> None:
        """Start copying unit ``k`` to the device (no-op if it is staged)."""
        unit = self.units[k]
        if unit.staged is not None:
            return
        hosts = [self._host[id(p)] for p in unit.params]
        unit.staged = [torch.empty_like(h, device=self.device) for h in hosts]
        if self._copy_stream is None:
            for staged, host in zip(unit.staged, hosts, strict=True):
                staged.copy_(host)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            for staged, host in zip(unit.staged, hosts, strict=True):
                staged.copy_(host, non_blocking=True)
            unit.ready = torch.cuda.Event()
            unit.ready.record(self._copy_stream)

    def _install(self, k: int) -> None:
        """Make unit ``k``'s staged copies its parameters' data, once they are written."""
        unit = self.units[k]
        if unit.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
        for p, staged in zip(unit.params, unit.staged, strict=True):
            p.data = staged

    def _release(self, k: int, *hook_args) -> None:
        """Free unit ``k``'s device copies (also its forward hook: ``hook_args`` unused)."""
        unit = self.units[k]
        for p in unit.params:
            p.data = self._placeholder[p.dtype]
        unit.staged = unit.ready = None

    def release(self) -> None:
        """Free every unit on the device (after a pass: the last one); memory a copy may
        still write is reused only after it."""
        staged = [k for k, unit in enumerate(self.units) if unit.staged is not None]
        if staged and self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        for k in staged:
            self._release(k)

    # ------------------------------------------------------------------ the host copies
    @contextlib.contextmanager
    def host_weights(self) -> Iterator[None]:
        """The host copies as the parameters' data for the block (re-entrant): what the
        block writes into the parameters is what later forwards stream."""
        if self._host_depth == 0:
            self.release()
            if self._copy_stream is not None:  # no copy reads a host tensor being written
                self._copy_stream.synchronize()
            for p in self._params:
                p.data = self._host[id(p)]
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1
            if self._host_depth == 0:
                for p in self._params:
                    p.data = self._placeholder[p.dtype]

    def _on_host(self, method):
        """``method`` of the model run inside ``host_weights``; the parameters in what
        it returns (``state_dict(keep_vars=True)``, ``sharded_state_dict``) become their
        host copies."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

        @functools.wraps(method)
        def on_host(*args, **kwargs):
            with self.host_weights():
                out = method(*args, **kwargs)
                if isinstance(out, dict):
                    dict_list_map_inplace(_detach_parameter, out)
            return out

        return on_host

    # ------------------------------------------------------------------ residency
    def unit_bytes(self) -> dict[str, int]:
        """Bytes of each unit's weights (what it holds on the device while resident)."""
        return {
            unit.name: sum(self._host[id(p)].nbytes for p in unit.params) for unit in self.units
        }

    def resident_units(self) -> list[str]:
        """The units with device copies now (computing or prefetched), in forward order."""
        return [unit.name for unit in self.units if unit.staged is not None]

    def device_bytes(self) -> int:
        """Device bytes the model's weights hold now (outside ``host_weights``): the
        parameters' storages and the staged copies, each storage once."""
        tensors = [*self._params, *(t for unit in self.units for t in unit.staged or ())]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


def offload_to_host(model: torch.nn.Module, device: torch.device) -> HostOffload:
    """Keep the frozen ``model``'s (a ``GPTModel`` stage, possibly in ``Float16Module``)
    weights on the host and stream them to ``device`` during its forwards (module
    docstring); its current weights become the host copies."""
    return HostOffload(model, device)


def host_offload(model: torch.nn.Module) -> HostOffload | None:
    """The ``HostOffload`` of ``model`` (wrapped or not), None if it is not offloaded."""
    from megatron.core.utils import unwrap_model

    return getattr(unwrap_model(model), OFFLOAD_ATTRIBUTE, None)


def release_device_weights(model: torch.nn.Module) -> None:
    """Free what an offloaded ``model``'s last pass left on the device (its last unit); a
    no-op for a model that is not offloaded. Call it once the pass's outputs are consumed."""
    offload = host_offload(model)
    if offload is not None:
        offload.release()


def host_weights(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """For a block that writes ``model``'s weights: an offloaded model's
    ``HostOffload.host_weights``, else nothing to do."""
    offload = host_offload(model)
    return contextlib.nullcontext() if offload is None else offload.host_weights()
