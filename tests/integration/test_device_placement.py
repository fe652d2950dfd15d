"""GPU readiness on CPU: every tensor where a CUDA run needs it (``tests/helpers/device_audit.py``
simulates the device), and the fused kernels chosen per device."""

import json
import os
import subprocess
import sys

import pytest
from rl_runs import ENV, ROOT, tiny_argv, torchrun

from loggra_megatron.model.build import fused_kernels

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI


def _reports(report_dir) -> list[dict]:
    return [json.load(open(os.path.join(report_dir, f"rank{r}.json"))) for r in (0, 1)]


@pytest.mark.parametrize(
    "parallel",
    [{"sft-iters": 2, "save-interval": 2}, {"pipeline-model-parallel-size": 2}],
    ids=["dp2-warmup-save", "pp2"],
)
def test_trainer_on_simulated_cuda_keeps_every_tensor_on_the_device(tokenizer, tmp_path, parallel):
    """`pretrain_rl.py --device cuda` on the simulated device: the policy and the reference
    (every parameter and buffer) are on the device, no op mixes device and host tensors, and
    no collective gets a host tensor (NCCL would reject it). DP=2 (with the supervised
    warm-up and a checkpoint save) and PP=2, with the reference model, predicted-KL control
    and a held-out evaluation."""
    report, held_out = tmp_path / "audit", tmp_path / "eval.jsonl"
    held_out.write_text(
        "".join(f'{{"prompt": "{a}+{a}=", "answer": "{2 * a}"}}\n' for a in range(4))
    )
    argv = tiny_argv(
        tokenizer,
        **{
            "bf16": True,
            "kl-coef": 0.01,
            "kl-target": 0.05,
            "rollout-engine": "static",
            "output-dir": tmp_path / "out",
            "eval-interval": 2,
            "eval-data-path": held_out,
            **({"save": tmp_path / "ckpt"} if "save-interval" in parallel else {}),
            **parallel,
        },
    )
    proc = torchrun([str(report), "--", *argv], script="tests/helpers/device_audit.py")
    for rank, r in enumerate(_reports(report)):
        assert r["exit"] == 0, f"rank {rank} exited {r['exit']}: {proc.stderr[-3000:]}"
        assert r["violations"] == [], f"rank {rank}:\n" + "\n".join(r["violations"])


_SELF_TEST = """
import torch, torch.distributed as dist, device_audit as da
audit = da.DeviceAudit(); da.install(audit)
dist.init_process_group(rank=0, world_size=1, init_method="tcp://127.0.0.1:{port}")
norm = torch.nn.RMSNorm(8)                                  # made on the host
lin = torch.nn.Linear(8, 8, device=torch.cuda.current_device())
da.audit_model(audit, norm, "norm"); da.audit_model(audit, lin, "linear")
x = torch.ones(2, 8, device="cuda")
norm(x)                                                     # device x host weight
dist.all_reduce(torch.zeros(2))                             # host tensor to NCCL
dist.all_reduce(torch.zeros(2, device="cuda"))              # fine
norm.cuda(); da.audit_model(audit, norm, "moved norm")     # fine after .cuda()
print(audit.violations)
"""


def test_the_audit_flags_what_a_gpu_would_reject():
    """The audit is not vacuous: a module left on the host, an op mixing devices and a host
    tensor in a collective are each flagged; moved and device tensors are not."""
    from loggra_megatron.testing import rendezvous_port

    code = _SELF_TEST.format(port=rendezvous_port())
    env = {**ENV, "PYTHONPATH": os.path.join(ROOT, "tests", "helpers")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    violations = eval(out.strip().splitlines()[-1])  # noqa: S307 (our own printed list)
    heads = [v.splitlines()[0] for v in violations]
    assert heads[0] == "norm weight: on the host device"
    assert any(h.startswith("op rms_norm mixes device tensors with host") for h in heads), heads
    assert sum("all_reduce on a host tensor" in h for h in heads) == 1, heads
    assert not any(h.startswith(("linear", "moved norm")) for h in heads), heads


def test_fused_kernels_follow_the_device(monkeypatch):
    """CPU: every fusion off. CUDA: Megatron-LM's defaults where the kernel exists (TE's
    fused RoPE only with TE layers; weight-gradient accumulation only with apex's kernel)."""
    import importlib.util

    assert not any(fused_kernels("cpu", use_te=True).values())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    local = fused_kernels("cuda", use_te=False)
    assert local["bias_activation_fusion"] and local["bias_dropout_fusion"]
    assert not local["apply_rope_fusion"] and not local["masked_softmax_fusion"]
    assert not local["gradient_accumulation_fusion"]
    te = fused_kernels("cuda", use_te=True)
    assert te["apply_rope_fusion"] and te["masked_softmax_fusion"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert fused_kernels("cuda", use_te=True)["gradient_accumulation_fusion"]
