#!/usr/bin/env bash
# GRPO of a 27B-class Llama/Qwen-style policy on ONE 8×H100/H200 node with LoGRA's backward
# sketch (--loggra-sketch backward: LoGRA as published, the sketch formed in the backward pass,
# no gradient buffer for the sketched linears, RowAdam; docs/optimizer.md) and predicted-KL
# step control (bf16 + FP8 via Transformer Engine on Hopper), TP=8 with sequence
# parallelism, full activation recompute, and the rollout KV cache bounded by
# --inference-max-tokens (32 of the 64 sequences of 16k tokens at once). --rollout-engine
# auto is Megatron-Core's dynamic engine on GPU; --rollout-engine static (this project's
# loop, in chunks of 32 rows) keeps the same KV budget.
#
# Expected memory per GPU, from the project's estimator (a model, not a measurement; see
# docs/memory.md), for tools/configs/llama-style-27b.json, the memory flags below and the
# allocator/NCCL settings this script exports (--expandable-segments --no-nccl-nvls):
#
#   python tools/estimate_memory.py --hf-config tools/configs/llama-style-27b.json \
#       --world-size 8 --gpu-memory-gb 79.1 --expandable-segments --no-nccl-nvls \
#       --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 --bf16 \
#       --fp8-format hybrid --fp8-recipe tensorwise --transformer-impl transformer_engine \
#       --sequence-parallel --recompute-granularity full --recompute-method uniform \
#       --recompute-num-layers 1 --seq-length 16384 --max-new-tokens 15360 \
#       --rollout-engine auto --inference-max-tokens 524288 --prompts-per-step 8 \
#       --num-generations 8 --global-batch-size 64 --micro-batch-size 1 \
#       --log-prob-micro-batch-size 4 --optimizer loggra --loggra-sketch backward \
#       --loggra-rank 128 --loggra-param-remainders --kl-target 0.01 --kl-estimator k3 \
#       --kl-probe-fraction 0.125 --kl-coef 0.001 --reference-offload
#
# prints (GiB per GPU): LoGRA bwd r=128 41.97 total, "yes (37.13 free)" of the 79.1 GiB
# PyTorch can allocate on an H100 80GB; dense Adam 83.60 ("NO (over by 4.50)"). Static 23.77
# (LoGRA) vs 65.41 (dense): weights 6.29 + FP8 weight cache 5.98 + fp32 grads 0.62 (the
# embeddings, output layer and norms only: the sketched linears have no grad buffer; dense
# 12.57) + masters 6.29 (bf16 weights + int16 remainders, --loggra-param-remainders; dense
# 12.57) + optimizer state 1.24 (RowAdam's moment per row, AdamW for the rest; dense 25.14)
# + sketch buffer S 0.51 + 2.00 runtime + 0.86 of NCCL ring buffers (3 communicators); the
# reference's weights are on the host (--reference-offload; otherwise its bf16 weights and
# FP8 cache stay on every GPU). Transient phases (one at a time): rollout 18.19 (the peak:
# KV cache 16.00 for 524288 tokens + 2.16 for the dynamic engine's prefill of the 32
# prompts in flight in one 32768-token forward), KL control 7.90 (probe in micro-batches of 4 sequences, its
# log-probs in chunks of 256 tokens: 1.61, plus the 6.29 backup of the weights a trial
# overwrites), the reference log-probs 1.92 (4 sequences per forward,
# --log-prob-micro-batch-size; the reference's two streamed layers 0.31; one optimizer update
# per RL step, so no recompute of the old log-probs), training 1.94, the optimizer step's
# sketch update 0.23.
# Without --inference-max-tokens it prints a KV cache of 32.00 (all 64 sequences of 16k
# tokens at once) and LoGRA 60.16 ("yes (18.94 free)"): it still fits, with less room.
# Without --expandable-segments it prints 57.97: the freed 16.00 KV buffer's
# segment, pinned by one tensor, is counted again ("rollout: fragmentation").
# With --nccl-nvls (NCCL_NVLS_ENABLE=1) it prints 0.75 of NCCL NVLS buffers and LoGRA 42.72
# ("yes (36.38 free)").
# With --loggra-sketch gradient (the older mode: the dense gradient in the fp32 grad buffer,
# 12.57, then sketched; optimizer state 2.67) it prints LoGRA r=128 54.84 ("yes (24.26
# free)"), static 36.65.
# tests/integration/test_gpu_scripts.py re-runs these on the flags of this file. Not measured on GPUs
# yet: benchmarks/gpu/h200_check.sh is the first check.
#
# Inputs: a converted checkpoint (tools/convert_checkpoint.py --direction hf-to-megatron
# --tensor-model-parallel-size 8, under torchrun with 8 CPU processes) and its tokenizer.
set -euo pipefail
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
CKPT=${CKPT:?converted Megatron checkpoint (tools/convert_checkpoint.py)}
TOKENIZER=${TOKENIZER:?sentencepiece .model or a Hugging Face tokenizer directory}
DATA=${DATA:?JSONL with prompt/answer}
OUT=${OUT:-runs/grpo_27b}
# Megatron needs one hardware queue per device so that TP/SP communication overlaps compute
export CUDA_DEVICE_MAX_CONNECTIONS=1
# The rollout frees a 16 GiB KV buffer every step: with expandable segments its pages are
# reused; without, one tensor left in its segment makes the next step's buffer need 16 GiB
# more (header). NCCL's NVLS buffers are off: 0.75 GiB per GPU here, 6.75 with older NCCL
# releases' larger ones (docs/memory.md); NCCL_NVLS_ENABLE=1.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# CUDA graphs (the rollout's decode steps) beside expandable segments need NCCL's buffer
# registration off (Megatron-Core's graph manager: an illegal memory access before Blackwell)
export NCCL_GRAPH_REGISTER=0
# Relaunching resumes this run; the first launch starts from the converted model.
LOAD="$CKPT"
[ -f "$OUT/latest_checkpointed_iteration.txt" ] && LOAD="$OUT"

torchrun --nproc-per-node 8 "$REPO"/pretrain_rl.py \
    --load "$LOAD" --tokenizer-model "$TOKENIZER" --data-path "$DATA" \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 \
    --bf16 --fp8-format hybrid --fp8-recipe tensorwise --transformer-impl transformer_engine \
    --sequence-parallel \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --seq-length 16384 --max-new-tokens 15360 \
    --rollout-engine auto --inference-max-tokens 524288 \
    --prompts-per-step 8 --num-generations 8 --global-batch-size 64 --micro-batch-size 1 \
    --log-prob-micro-batch-size 4 \
    --train-iters 500 --lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0.0 \
    --optimizer loggra --loggra-sketch backward --loggra-rank 128 --loggra-param-remainders \
    --kl-target 0.01 --kl-estimator k3 --kl-probe-fraction 0.125 \
    --kl-coef 0.001 --kl-ref-estimator k3 --reference-offload \
    --loss-aggregation token_mean --clip-low 0.2 --clip-high 0.28 \
    --overlap-grad-reduce --overlap-param-gather \
    --save "$OUT" --save-interval 25 --wandb-project loggra-grpo "$@"
