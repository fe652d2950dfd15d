"""The optimizers ``pretrain_rl.py`` can train with (``--optimizer``), by name.

Each ``OptimizerSpec`` says how to build the Megatron-Core optimizer and what the rest
of the code needs to know of it, as Megatron's ``EmergingOptimizerEntry`` does for its own
registry: how its state is laid out and counted (the memory model), how that state is
allocated before a checkpoint is loaded into it (``optim/megatron/optimizer_state``), whether
Megatron's distributed optimizer can hold it and whether predicted-KL control can try its
update before committing it (``arguments.validate``, exit 2 before any process group). Imports
neither torch nor Megatron; builders and state initialisers are imported when called.
Adding an optimizer variant: one builder module, one line in ``OPTIMIZERS``
(``docs/architecture.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


def resolve(reference: str):
    """The object a ``"module:name"`` reference names (the module is imported now)."""
    module, _, name = reference.partition(":")
    return getattr(import_module(module), name)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    description: str
    builder: str
    """``"module:function"``: ``function(optim, loggra, model_chunks, prepared) ->
    MegatronOptimizer`` with the ``OptimConfig`` and ``LoGRAConfig`` sections, and, per chunk,
    what ``prepare_model`` returned for it (``None`` without one)."""
    sketched: bool
    """Adam's moments of 2-D transformer weights live in low-rank sketches (else dense)."""
    grads_per_weight: bool
    """With bf16 grad buffers it converts one weight's gradient at a time to fp32 (else
    Megatron copies every shard before the step)."""
    distributed: bool
    """Megatron's ``DistributedOptimizer`` can hold it (``--use-distributed-optimizer``, the
    default): that class takes Adam only ("Only Adam ... currently supported, due to
    checkpointing requirements"); LoGRA replaces the Adam it was built with."""
    candidate: bool
    """Its inner optimizer computes a side-effect-free candidate update ``θ + η·Δθ``
    (``write_candidate``), which predicted-KL control
    (``--kl-target``) tries before it commits a step."""
    state_bytes_per_param: int
    """Bytes of optimizer state per element of a densely updated parameter, in fp32 (Adam's
    two moments: 8, SGD's momentum: 4, plain SGD: 0); the memory model counts them (LoGRA's
    sketched weights by their own formula)."""
    state_bytes_per_tensor: int = 0
    """Bytes of per-tensor scalars (torch AdamW's fp32 ``step``: 4; LoGRA's int64 step: 8)."""
    precision_aware: bool = False
    """Megatron's precision-aware optimizer can run it (TE's FusedAdam: moments at
    ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``, masters as remainders with bf16 moments);
    the memory model reads those dtypes for it only."""
    prepare_model: str | None = None
    """``"module:function"``: ``function(model, optim, loggra) -> prepared`` prepares the
    (unwrapped) policy before DDP wraps it (``train.build.trainable_policy``), e.g. freezes
    and hooks the backward sketch's targets; what it returns goes to the builder. None:
    nothing to prepare."""
    init_state: str | None = None
    """``"module:function"``: ``function(optimizer, config=None)`` gives every parameter of a
    torch optimizer its state (zeros), as Megatron's ``init_state_fn``, so that a checkpoint
    can be loaded into an optimizer that has not stepped yet. the factory installs it on every
    leaf (``optim.megatron.factory.build_optimizer``). None: the optimizer Megatron builds
    has its own (Adam) or checkpoints its state itself (LoGRA)."""


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adam": OptimizerSpec(
        "adam",
        "Megatron's dense (distributed) Adam",
        "loggra_megatron.optim.megatron.factory:build_dense_adam",
        sketched=False,
        grads_per_weight=False,
        distributed=True,
        candidate=True,
        state_bytes_per_param=8,
        state_bytes_per_tensor=4,
        precision_aware=True,
    ),
    "loggra": OptimizerSpec(
        "loggra",
        "LoGRA: Adam's moments in low-rank gradient sketches",
        "loggra_megatron.optim.megatron.factory:build_loggra",
        sketched=True,
        grads_per_weight=True,
        distributed=True,
        candidate=True,
        state_bytes_per_param=8,
        state_bytes_per_tensor=8,
        prepare_model="loggra_megatron.optim.megatron.factory:prepare_model",
    ),
}


@dataclass(frozen=True)
class SketchMode:
    """One ``--loggra-sketch`` mode of a sketching optimizer, what the factory builds for it
    and what the rest of the code reads of it (nothing compares mode names:
    ``tests/unit/test_registries.py``)."""

    name: str
    description: str
    builder: str
    """``"module:function"``: ``function(config, loggra, model_chunks, sites, **kwargs)``,
    the Megatron optimizer of the DDP-wrapped chunks (Megatron's ``OptimizerConfig``; ``sites``:
    what ``prepare_model`` returned, per chunk)."""
    in_backward: bool
    """The sketch is formed in the backward pass: the targets get no dense gradient (the
    mode's ``prepare_model`` freezes and hooks them before DDP wraps the model), the dense
    leaves sketch nothing, and the memory model counts the targets' own terms
    (``memory/backward_sketch.py``)."""
    label: str
    """What the memory estimator's column adds to ``LoGRA r=<rank>``."""
    checkpoint_tag: str
    """What a checkpoint of this mode records as its mode (``optim.megatron.checkpoint``,
    ``backward_optimizer``); a load into another mode is refused by it."""
    prepare_model: str | None = None
    """``"module:function"``: ``function(model, optim, loggra) -> sites`` prepares the
    unwrapped policy before DDP wraps it; the builder takes what it returns. None: nothing."""
    settings: str | None = None
    """``"module:Class"``: the dataclass of the flags this mode owns (a field per flag, its
    docstring the help, validation in its ``__post_init__``); ``optim.config.LoGRAConfig``
    gathers them, each applying to this mode only. None: the mode has none of its own."""
    memory_terms: str | None = None
    """``"module:function"``: ``function(model, plan, stage, params, dp) -> SketchTerms``,
    what the mode adds to the memory model's step on one GPU (its targets' masters, row state,
    buffer, hooks, step transient; resolved by ``memory.model``, which imports nothing of it).
    None: nothing beyond the optimizer entry's state (the gradient sketch's is LoGRA-AdamW's,
    ``memory/params``)."""


SKETCH_MODES: dict[str, SketchMode] = {
    "gradient": SketchMode(
        "gradient",
        "sketch the dense gradient: range-finder basis, Adam moments in the sketch",
        "loggra_megatron.optim.megatron.factory:build_gradient_sketch",
        in_backward=False,
        label="",
        checkpoint_tag="gradient",
        settings="loggra_megatron.optim.gradient_sketch.settings:GradientSketchSettings",
    ),
    "backward": SketchMode(
        "backward",
        "form the sketch in the backward pass (LoGRA as published): no dense gradient of a "
        "target, RowAdam",
        "loggra_megatron.optim.megatron.factory:build_backward_sketch",
        in_backward=True,
        label=" bwd",
        checkpoint_tag="backward",
        settings="loggra_megatron.optim.backward_sketch.settings:BackwardSketchSettings",
        prepare_model="loggra_megatron.optim.megatron.backward_sites:prepare_model",
        memory_terms="loggra_megatron.memory.backward_sketch:sketch_terms",
    ),
}
"""``--loggra-sketch``, by name."""
UNTAGGED_SKETCH = SKETCH_MODES["gradient"].checkpoint_tag
"""The tag of a LoGRA checkpoint from before checkpoints named their mode."""


def backward_sketch(optimizer: str, sketch: str) -> bool:
    """Whether ``--optimizer optimizer --loggra-sketch sketch`` sketches in the backward pass
    (a sketching optimizer in a backward mode)."""
    return OPTIMIZERS[optimizer].sketched and SKETCH_MODES[sketch].in_backward


SKETCH_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""``--loggra-targets`` names: the transformer-layer linears the backward sketch can own."""


def sketches_shape(shape: tuple[int, ...], min_dim: int) -> bool:
    """LoGRA's default rule for a transformer weight: 2-D with both sides ≥ ``min_dim`` (the
    projections' ``sketches`` and the memory
    model use it)."""
    return len(shape) == 2 and min(shape) >= min_dim
