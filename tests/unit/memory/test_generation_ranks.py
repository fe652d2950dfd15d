"""The memory model of ``--generation-ranks``: the training GPUs hold no rollout, and a
generation GPU holds the policy's weights at its own TP size and its share of the rollout."""

import dataclasses

from memory_plans import plan
from optimizer_state import SMALL

from loggra_megatron.memory.model import (
    TransformerShape,
    estimate_generation_memory,
    estimate_rl_step_memory,
    kv_cache_bytes,
    stage_parameters,
    weight_bytes,
)

MODEL = TransformerShape(**SMALL, untie_embeddings_and_output_weights=True)


def test_training_gpus_hold_no_rollout_and_keep_everything_else():
    colocated = plan(rollout_batch_size=16, data_parallel_size=2, kl_trial_rows=0)
    split = dataclasses.replace(colocated, generation_ranks=2)
    a, b = (estimate_rl_step_memory(MODEL, p) for p in (colocated, split))
    assert a.kv_cache > 0 and a.prefill_activations > 0 and a.rollout_logits > 0
    assert b.kv_cache == b.prefill_activations == b.rollout_logits == 0
    assert b.static_bytes == a.static_bytes and b.training_bytes == a.training_bytes


def test_a_generation_gpu_holds_weights_at_its_tp_and_its_share_of_the_rollout():
    step = plan(rollout_batch_size=16, data_parallel_size=2, tensor_model_parallel_size=1)
    step = dataclasses.replace(step, generation_ranks=4, generation_tensor_model_parallel_size=2)
    gen = estimate_generation_memory(MODEL, step)
    g = step.generation_plan()
    assert (g.tensor_model_parallel_size, g.data_parallel_size) == (2, 2)
    assert g.rollout_batch_size == 16  # 32 rollouts over 2 replicas
    assert not g.reference_model and g.kl_trial_rows == 0
    params = stage_parameters(MODEL, g, 0)
    assert gen.weights == weight_bytes(params, 2 if step.precision == "bf16" else 4)
    assert gen.grads == gen.master_params == gen.optimizer_state == gen.activations == 0
    assert gen.kv_cache == kv_cache_bytes(MODEL, g, 16, g.seq_length)
    assert gen.peak_phase == "rollout"
