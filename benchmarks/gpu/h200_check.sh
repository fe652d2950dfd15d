#!/usr/bin/env bash
# GPU check on one H200 (or H100), self-contained, < 8 minutes: a ~1B Llama-style bf16 policy
# (+ bf16 reference), dense Adam vs LoGRA (rank hidden/8) inside Megatron's distributed
# optimizer: peak memory (torch.cuda.max_memory_allocated) and step time of one RL step.
# Results go to ${RESULTS:-$OUT/h200_check.txt} (or ./h200_check.txt).
#
# The machine needs megatron-core (and its pure-Python dependencies) importable: carry
# wheels as the device README describes, or run inside docker/Dockerfile's image.
# FP8 (Transformer Engine) is reported as available or not; an FP8 memory/step-time run
# is not part of this script yet.
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-${OUT:-.}/h200_check.txt}
{
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
  python -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
  python -c "import transformer_engine as te; print('transformer_engine', te.__version__, '(FP8 available)')" \
    2>/dev/null || echo "transformer_engine not importable: no FP8 run"
  # ~1.1B parameters: 16 layers, hidden 2048, SwiGLU 5632, 16 heads, vocab 32000, 2k tokens.
  timeout 420 python benchmarks/memory_rl.py --device cuda --layers 16 --hidden 2048 \
      --ffn 5632 --heads 16 --vocab 32000 --seq 2048 --bf16-grads --timed-steps 3
} 2>&1 | tee "$RESULTS"
