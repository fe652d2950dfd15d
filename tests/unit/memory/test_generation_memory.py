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


def test_a_lowrank_sync_sends_r_columns_of_fp32_per_sketched_row():
    from loggra_megatron.memory.backward_sketch import target_of
    from loggra_megatron.memory.model import weight_sync_bytes

    step = plan(optimizer="loggra", loggra_sketch="backward", precision="bf16")
    params = stage_parameters(MODEL, step, 0)
    targets = [s for s in params if s.kind == "linear" and target_of(s) in step.loggra_targets]
    rest = sum(s.numel for s in params if s not in targets)
    sync = weight_sync_bytes(MODEL, step, rank=4)
    assert sync["full"] == sum(s.numel for s in params) * 2
    assert sync["lowrank"] == sum(s.shape[0] for s in targets) * 4 * 4 + rest * 2
    frozen = weight_sync_bytes(MODEL, dataclasses.replace(step, freeze_non_targets=True), rank=4)
    assert frozen["lowrank"] == sum(s.shape[0] for s in targets) * 4 * 4


def test_the_lowrank_sync_state_is_counted_on_the_generation_gpu():
    step = plan(
        optimizer="loggra", loggra_sketch="backward", precision="bf16", rollout_batch_size=4
    )
    step = dataclasses.replace(step, generation_ranks=1, generation_tensor_model_parallel_size=1)
    full = estimate_generation_memory(MODEL, step)
    low = estimate_generation_memory(MODEL, dataclasses.replace(step, weight_sync="lowrank"))
    rem = estimate_generation_memory(
        MODEL, dataclasses.replace(step, weight_sync="lowrank", loggra_param_remainders=True)
    )
    assert full.sync_state == 0 and low.sync_state == 2 * rem.sync_state > 0  # masters only
    assert low.total_bytes == full.total_bytes + low.sync_state
    # another TP size than the trainer's: every shard, weights too, in the trainer's layout
    other = dataclasses.replace(
        step, weight_sync="lowrank", generation_tensor_model_parallel_size=2
    )
    other = dataclasses.replace(other, generation_ranks=2)
    assert estimate_generation_memory(MODEL, other).sync_state == 3 * low.sync_state // 2
