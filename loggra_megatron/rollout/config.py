"""Settings of rollout generation (sampling from the policy)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from loggra_megatron.config import applies, at_least, check_fields, one_of, positive
from loggra_megatron.rollout.registry import engine_choices


@dataclass
class RolloutConfig:
    """How completions are sampled."""

    max_new_tokens: int = 32
    """Maximum response tokens."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = applies(1.0, "with --temperature > 0", lambda s: s["temperature"] > 0)
    """Nucleus sampling."""
    rollout_engine: str = "auto"
    """static (this project's KV-cached loop, CPU and GPU) | dynamic (Megatron-Core's
    DynamicInferenceEngine: paged KV cache, continuous batching; GPU only) | auto (dynamic
    where it can run, else static; see loggra_megatron.rollout.registry)."""
    rollout_cuda_graphs: bool = True
    """Decode steps as CUDA graphs on a GPU: the static engine captures each step (per
    attention width, rollout/static/decoder.py), the dynamic engine Megatron-Core's layer graphs per
    decode batch size (rollout/mcore_engine.decode_graphs); --rollout-fp8 decodes eagerly. Off: eager
    decode steps (to profile or debug); refused on CPU, where there are no CUDA graphs (the
    static step runs through the graph stand-in)."""
    rollout_fp8: bool = applies(False, "with --fp8-format", lambda s: s["fp8_format"] is not None)
    """Rollouts decode with Transformer Engine's FP8 GEMMs, as the training forward computes,
    eagerly (FP8 decode steps are not captured). Default: an FP8 run decodes with its bf16
    weights outside FP8, through CUDA graphs (--rollout-cuda-graphs): the rollout needs no FP8
    weights, and π_old then comes from the training forward or its recompute, never from the
    bf16 sampling log-probs (docs/rollouts.md, "Precision")."""
    inference_dynamic_batching_num_cuda_graphs: int = applies(
        16,
        "with --rollout-engine dynamic or auto and --rollout-cuda-graphs",
        lambda s: s["rollout_engine"] != "static" and s["rollout_cuda_graphs"],
    )
    """Decode batch sizes the dynamic engine captures as CUDA graphs (Megatron-LM's flag and
    default; Megatron-Core's ``num_cuda_graphs``): a decode step runs the smallest captured
    size that holds its requests. More sizes pad less and capture longer at each rollout.
    Refused where --rollout-engine auto takes the static engine (on CPU)."""
    inference_max_tokens: int | None = None
    """Bound on the rollout KV cache, in tokens: the static engine generates in chunks of
    rows with rows × (longest prompt + --max-new-tokens) ≤ this; the dynamic engine sizes its
    paged buffer to it. Default: on a GPU, sized at start-up by the memory model for the GPU's
    memory (the whole rollout batch where it fits, else as many rows as fit; printed:
    memory/kv_budget.py); on CPU the whole rollout batch at once."""

    def __post_init__(self):
        engines = engine_choices()
        check_fields(
            self,
            [
                ("max_new_tokens", positive, ">= 1"),
                ("temperature", at_least(0), ">= 0 (0: greedy)"),
                ("top_p", lambda p: 0 < p <= 1, "in (0, 1]"),
                ("rollout_engine", one_of(*engines), f"one of {', '.join(engines)}"),
                ("inference_dynamic_batching_num_cuda_graphs", positive, ">= 1"),
                ("inference_max_tokens", positive, ">= 1"),
            ],
        )

    def decodes_apart(self, fp8_format: str | None) -> bool:
        """The rollout decodes in another precision than the training forward computes (an
        FP8 run without ``--rollout-fp8``): its sampling log-probs are not π_old."""
        return fp8_format is not None and not self.rollout_fp8

    def problems_with(self, engine: str, cuda: bool) -> Iterator[str]:
        """``--flag=value: ...`` for each setting given a value of its own that would do
        nothing with the engine the run takes (``engine``, ``auto`` resolved) on its device
        (``cuda``: a GPU, else CPU), as ``config.settings_that_do_not_apply`` words it."""
        default = {f.name: f.default for f in dataclasses.fields(self)}
        graphs = self.inference_dynamic_batching_num_cuda_graphs
        if engine == "static" and graphs != default["inference_dynamic_batching_num_cuda_graphs"]:
            yield (
                f"--inference-dynamic-batching-num-cuda-graphs={graphs!r}: applies with the "
                f"dynamic engine only, and --rollout-engine {self.rollout_engine} takes the "
                "static engine here (here it would do nothing); drop it"
            )
        if not cuda and not self.rollout_cuda_graphs:
            yield (
                "--no-rollout-cuda-graphs: applies on a GPU only, and this run computes on CPU "
                "(--device cpu, or no CUDA device visible; here it would do nothing); drop it"
            )
