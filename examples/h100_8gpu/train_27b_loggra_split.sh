#!/usr/bin/env bash
# The 27B GRPO run of train_27b_loggra.sh split as the LoGRA paper's own 27B run was: 4 GPUs
# of the node train (TP=4, sequence parallelism) and the other 4 generate
# (--generation-ranks 4 --generation-tensor-model-parallel-size 4: one replica), in lock-step,
# with the trainer's weights synced to them after every update as the backward sketch's row
# updates (--weight-sync lowrank; docs/placement.md). The training GPUs hold no KV cache; the
# generation GPUs hold no gradient or optimizer state, and a copy of the masters of their
# shards of the sketched weights.
#
# Expected memory per GPU, from the project's estimator (a model, not a measurement;
# docs/memory.md), for the flags below:
#
#   python tools/estimate_memory.py --hf-config tools/configs/llama-style-27b.json \
#       --world-size 8 --gpu-memory-gb 79.1 --expandable-segments --no-nccl-nvls \
#       --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --generation-ranks 4 \
#       --generation-tensor-model-parallel-size 4 --weight-sync lowrank --bf16 --fp8-format hybrid \
#       --fp8-recipe tensorwise --transformer-impl transformer_engine --sequence-parallel \
#       --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
#       --seq-length 16384 --max-new-tokens 15360 --rollout-engine auto \
#       --inference-max-tokens 524288 --prompts-per-step 8 --num-generations 8 \
#       --global-batch-size 64 --micro-batch-size 1 --log-prob-micro-batch-size 4 \
#       --optimizer loggra --loggra-sketch backward --loggra-rank 128 \
#       --loggra-param-remainders --kl-target 0.01 --kl-estimator k3 \
#       --kl-probe-fraction 0.125 --kl-coef 0.001 --reference-offload --kl-backup-offload
#
# prints (GiB per training GPU): LoGRA bwd r=128 48.15 total, "yes (30.95 free)"; dense Adam
# 131.74 ("NO (over by 52.64)"). LoGRA's static 44.34 (weights 12.57 + FP8 weight cache 11.95
# + grads 1.23 + masters 12.57 + optimizer state 2.46 + sketch buffer 0.70 + runtime 2.00 +
# NCCL 0.86); its peak phase is the reference's log-probs, 3.81. Predicted-KL control's
# copy of the weights a trial overwrites (12.57 on the GPU without --kl-backup-offload, which
# then makes its phase the peak) is on the host: 12.57 GiB of pinned host memory per training
# GPU, copied there once per optimizer step and back after each trial. The generation GPUs:
# 68.15 each
# (weights 12.57, FP8 weight cache 5.98, the low-rank sync's copy of the masters 11.95, KV
# cache 32.00 for the 524288-token budget at TP=4, prefill 2.76). A weight sync after the
# first sends 4.32 GiB, against 50.26 for a full one.
# Colocated (--generation-ranks 0 --world-size 4: the same 4 GPUs also generate) it prints
# 79.13: the KV cache, 32.00, and the prefill, 2.76, are then on the training GPUs.
#
# Inputs: a converted checkpoint (tools/convert_checkpoint.py --direction hf-to-megatron
# --tensor-model-parallel-size 4) and its tokenizer.
set -euo pipefail
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
CKPT=${CKPT:?converted Megatron checkpoint (tools/convert_checkpoint.py)}
TOKENIZER=${TOKENIZER:?sentencepiece .model or a Hugging Face tokenizer directory}
DATA=${DATA:?JSONL with prompt/answer}
OUT=${OUT:-runs/grpo_27b_split}
# Megatron needs one hardware queue per device so that TP/SP communication overlaps compute
export CUDA_DEVICE_MAX_CONNECTIONS=1
# The generation GPUs free their KV buffer every step (expandable segments reuse its pages);
# NCCL's NVLS buffers are off (train_27b_loggra.sh, docs/memory.md).
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export NCCL_GRAPH_REGISTER=0
LOAD="$CKPT"
[ -f "$OUT/latest_checkpointed_iteration.txt" ] && LOAD="$OUT"

torchrun --nproc-per-node 8 "$REPO"/pretrain_rl.py \
    --load "$LOAD" --tokenizer-model "$TOKENIZER" --data-path "$DATA" \
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 \
    --generation-ranks 4 --generation-tensor-model-parallel-size 4 --weight-sync lowrank \
    --bf16 --fp8-format hybrid --fp8-recipe tensorwise --transformer-impl transformer_engine \
    --sequence-parallel \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --seq-length 16384 --max-new-tokens 15360 \
    --rollout-engine auto --inference-max-tokens 524288 \
    --prompts-per-step 8 --num-generations 8 --global-batch-size 64 --micro-batch-size 1 \
    --log-prob-micro-batch-size 4 \
    --train-iters 500 --lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0.0 \
    --optimizer loggra --loggra-sketch backward --loggra-rank 128 --loggra-param-remainders \
    --kl-target 0.01 --kl-estimator k3 --kl-probe-fraction 0.125 --kl-backup-offload \
    --kl-coef 0.001 --kl-ref-estimator k3 --reference-offload \
    --loss-aggregation token_mean --clip-low 0.2 --clip-high 0.28 \
    --overlap-grad-reduce --overlap-param-gather \
    --save "$OUT" --save-interval 25 --wandb-project loggra-grpo "$@"
