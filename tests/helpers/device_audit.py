"""A CUDA device simulated on CPU, to find tensors that a GPU run would hold on the wrong
device (the GPU path never runs in CI).

``DeviceAudit`` is a ``TorchFunctionMode`` pushed *above* the CPU mode of
``cpu``, so it sees every torch call with its original arguments, and tags
each tensor ``device`` (made with a CUDA ``device=``, ``.cuda()``/``.to(cuda)``, or computed
from a ``device`` tensor) or ``host`` (a factory without a device, ``.cpu()``, or computed
from host tensors only); autograd's gradients carry no tag and are never flagged.
Violations, each with a short stack: an op mixing a ``device`` tensor with a ``host`` tensor
of one or more dimensions (CUDA's "Expected all tensors to be on the same device"; copies
are not ops that mix); a ``torch.distributed`` call on a ``host`` tensor (NCCL rejects it);
after the model is built, a parameter or buffer that is not a ``device`` tensor.

``python tests/helpers/device_audit.py REPORT_DIR -- pretrain_rl flags`` (under torchrun) runs
``pretrain_rl.py`` with ``--device cuda`` on this simulated device (gloo underneath) and writes
``REPORT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "eye",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "from_numpy",
    "scalar_tensor",
}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}
_NEW = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
_TRANSFERS = {
    "copy_",
    "__setitem__",
    "__getitem__",
    "index_select",
    "to",
    "set_",
    "__set__",
    "__get__",
}
_CUDA0 = torch.device("cuda", 0)
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
    "gather",
    "scatter",
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_to_all_single",
)
DEVICE, HOST = "device", "host"


def _is_cuda(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return isinstance(dev, str) and dev.startswith("cuda")


def tag_of(t) -> str | None:
    return getattr(t, "_audit_loc", None) if isinstance(t, torch.Tensor) else None


def _set_tag(t, tag) -> None:
    if isinstance(t, torch.Tensor) and tag is not None:
        with contextlib.suppress(AttributeError, RuntimeError):
            t._audit_loc = tag


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


class DeviceAudit(TorchFunctionMode):
    """Tags tensors with their simulated device and records violations (module docstring)."""

    def __init__(self):
        super().__init__()
        self.violations: list[str] = []

    def flag(self, what: str) -> None:
        if len(self.violations) < 50:
            stack = traceback.format_stack(limit=8)[:-2]
            here = [line.strip().splitlines()[0] for line in stack if "device_audit" not in line]
            self.violations.append(f"{what}\n    " + "\n    ".join(here[-4:]))

    def _placed(self, name, args, kwargs):
        """The tag an explicit placement gives the output, or None if the call places
        nothing."""
        if "device" in kwargs and kwargs["device"] is not None:
            return DEVICE if _is_cuda(kwargs["device"]) else HOST
        if name == "cuda":
            return DEVICE
        if name == "cpu":
            return HOST
        if name == "to":
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    return tag_of(a)
                if isinstance(a, str | torch.device | int) and not isinstance(a, bool):
                    return DEVICE if _is_cuda(a) else HOST
            return None
        if name in _NEW:
            return tag_of(args[0])
        if name in _LIKE:
            return tag_of(args[0])
        if name in _FACTORIES:
            return HOST
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.device or owner is torch.Tensor.is_cuda:  # a device tensor
            on_device = tag_of(args[0]) == DEVICE  # reports CUDA, as on a GPU machine
            if owner is torch.Tensor.is_cuda:
                return on_device or func(*args, **kwargs)
            return _CUDA0 if on_device else func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        placed = self._placed(name, args, kwargs)
        if placed is None:
            tags = [(tag_of(t), t) for t in _tensors((args, kwargs))]
            has_device = any(tag == DEVICE for tag, _ in tags)
            host_arrays = [t for tag, t in tags if tag == HOST and t.ndim > 0]
            if has_device and host_arrays and name not in _TRANSFERS:
                shapes = [tuple(t.shape) for t in host_arrays]
                self.flag(f"op {name} mixes device tensors with host tensors of shapes {shapes}")
            known = [tag for tag, _ in tags if tag is not None]
            placed = DEVICE if has_device else (HOST if known and len(known) == len(tags) else None)
            if name == "__set__" and len(args) >= 2:  # param.data = x: the param follows x
                _set_tag(args[0], tag_of(args[1]))
        out = func(*args, **kwargs)
        for t in _tensors(out):
            _set_tag(t, placed)
        return out


def _wrap_collective(audit: DeviceAudit, name: str, fn):
    def wrapped(*args, **kwargs):
        for t in _tensors((args, kwargs)):
            if tag_of(t) == HOST:
                audit.flag(f"torch.distributed.{name} on a host tensor of shape {tuple(t.shape)}")
        return fn(*args, **kwargs)

    return wrapped


def install(audit: DeviceAudit) -> None:
    """Simulate CUDA in this process: the CPU mode, then the audit above it; Parameters keep
    their data's tag; collectives are checked; NCCL becomes gloo; CUDA generators CPU ones."""
    from loggra_megatron.cpu import enable_cpu_megatron

    enable_cpu_megatron()
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    new_param = torch.nn.Parameter.__new__

    def param_new(cls, data=None, requires_grad=True):
        p = new_param(cls, data, requires_grad)
        _set_tag(p, tag_of(data))
        return p

    torch.nn.Parameter.__new__ = param_new
    generator = torch.Generator
    torch.Generator = lambda device="cpu": generator(device="cpu")  # noqa: ARG005
    init = dist.init_process_group
    dist.init_process_group = lambda backend=None, **kw: init("gloo", **kw)
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _wrap_collective(audit, name, getattr(dist, name)))
    for name in ("isend", "irecv"):  # P2POp checks its op against c10d's own functions
        setattr(dist.distributed_c10d, name, getattr(dist, name))
    _step_graphs_on_the_host()
    _no_capture_on_the_host()
    audit.__enter__()


def _step_graphs_on_the_host() -> None:
    """The simulated device's tensors live on the host, where ``torch.cuda.CUDAGraph`` cannot
    capture: the static engine's decode steps take ``StepGraphs``' own stand-in, which holds
    them to what a capture enforces (``rollout/static/step_graph.py``)."""
    from loggra_megatron.rollout.static import step_graph

    init = step_graph.StepGraphs.__init__

    def standin(self, device, capture):
        init(self, torch.device("cpu"), False)

    step_graph.StepGraphs.__init__ = standin


class _HostStream:
    """The simulated device's one stream: it never captures a graph."""

    def is_capturing(self) -> bool:
        return False


def _no_capture_on_the_host() -> None:
    """torch's optimizers ask the current accelerator stream whether a CUDA graph is being
    captured (torch 2.14's ``_accelerator_graph_capture_health_check``); with CUDA reported
    available, a CUDA build of torch would initialise the driver to answer. The simulated
    device answers itself: nothing is captured on the host."""
    torch.cuda.is_current_stream_capturing = lambda: False
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_stream = lambda device=None: _HostStream()  # noqa: ARG005


def audit_model(audit: DeviceAudit, model, what: str) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if tag_of(t) != DEVICE:
            audit.violations.append(f"{what} {name}: on the {tag_of(t) or 'unknown'} device")


def run_pretrain_rl(audit: DeviceAudit, argv: list[str]) -> int:
    """``pretrain_rl.py argv --device cuda`` on the simulated device (``install`` done),
    the built models audited; returns the exit code."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import pretrain_rl
    from loggra_megatron.model import build as build_module
    from loggra_megatron.train import trainer as trainer_module

    setup = trainer_module.RLTrainer.setup

    def audited_setup(self):
        out = setup(self)
        audit_model(audit, self.policy, "policy")
        if self.reference is not None:
            audit_model(audit, self.reference, "reference")
        return out

    trainer_module.RLTrainer.setup = audited_setup
    # The fused kernels are TorchScript/torch.compile code for a real GPU (unit-tested apart)
    fused = build_module.fused_kernels
    build_module.fused_kernels = lambda device_type, use_te: fused("cpu", use_te)
    try:
        pretrain_rl.main([*argv, "--device", "cuda"])
    except SystemExit as e:
        return e.code or 0
    return 0


def write_report(report_dir: str, report: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(report_dir, exist_ok=True)
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)


def main(report_dir: str, argv: list[str]) -> int:
    """Run ``pretrain_rl.py argv --device cuda`` on the simulated device; write the report."""
    audit = DeviceAudit()
    install(audit)
    code = run_pretrain_rl(audit, argv)
    write_report(report_dir, {"exit": code, "violations": audit.violations})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[3:]))
