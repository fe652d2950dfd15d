#!/usr/bin/env bash
# GRPO of a 27B-class Llama/Qwen-style policy on ONE 8×H100/H200 node with LoGRA and
# predicted-KL step control (bf16 + FP8 via Transformer Engine on Hopper).
#
# Expected memory (tools/estimate_memory.py, docs/memory.md; TP=8, 16k tokens, 64
# concurrent rollouts, full recompute, reference on GPU): dense Adam ~96.9 GiB/GPU (does not
# fit 80 GB), LoGRA rank 128 ~74.4 GiB/GPU (fits). With FP8, TE keeps extra FP8 weight
# copies (~+5.9 GiB): lower --prompts-per-step or --max-new-tokens if it gets tight.
# --grad-reduce-in-bf16 halves the grad buffer (-6.3 GiB/GPU; LoGRA reads bf16 grads without
# Megatron's fp32 copy) at the price of accumulating the 64 micro-batches' grads in bf16.
#
# Inputs: a converted checkpoint (tools/convert_checkpoint.py --direction hf-to-megatron
# --tensor-model-parallel-size 8) and its sentencepiece tokenizer.
set -euo pipefail
CKPT=${CKPT:?converted Megatron checkpoint (tools/convert_checkpoint.py)}
TOKENIZER=${TOKENIZER:?sentencepiece .model}
DATA=${DATA:?JSONL with prompt/answer}
OUT=${OUT:-runs/grpo_27b}
# Relaunching resumes this run; the first launch starts from the converted model.
LOAD="$CKPT"
[ -f "$OUT/latest_checkpointed_iteration.txt" ] && LOAD="$OUT"

torchrun --nproc-per-node 8 pretrain_rl.py \
    --load "$LOAD" --tokenizer-model "$TOKENIZER" --data-path "$DATA" \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 \
    --bf16 --fp8-format hybrid --fp8-recipe delayed --transformer-impl transformer_engine \
    --seq-length 16384 --max-new-tokens 15360 \
    --prompts-per-step 8 --num-generations 8 --global-batch-size 64 --micro-batch-size 1 \
    --train-iters 500 --lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0.0 \
    --optimizer loggra --loggra-rank 128 --loggra-update-interval 200 \
    --kl-target 0.01 --kl-estimator k3 --kl-probe-fraction 0.125 \
    --kl-coef 0.001 --kl-ref-estimator k3 \
    --loss-aggregation token_mean --clip-low 0.2 --clip-high 0.28 \
    --overlap-grad-reduce --overlap-param-gather \
    --save "$OUT" --save-interval 25 --wandb-project loggra-grpo "$@"
