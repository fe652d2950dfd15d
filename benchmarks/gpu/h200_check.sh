#!/usr/bin/env bash
# GPU check on one H200 (or H100), self-contained, < 8 minutes: a ~1B Llama-style bf16 policy
# (+ bf16 reference), dense Adam vs LoGRA (rank hidden/8) inside Megatron's distributed
# optimizer: peak memory (torch.cuda.max_memory_allocated) and step time of one RL step.
# Results go to ${RESULTS:-$OUT/h200_check.txt} (or ./h200_check.txt).
#
# The machine needs megatron-core (and its pure-Python dependencies) importable: carry
# wheels as the device README describes, or run inside docker/Dockerfile's image.
# FP8: when transformer_engine is importable the same measurement is repeated with TE layers
# and FP8 GEMMs (--fp8 hybrid, delayed scaling).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-${OUT:-.}/h200_check.txt}
# ~1.1B parameters: 16 layers, hidden 2048, SwiGLU 5632, 16 heads, vocab 32000, 2k tokens.
SHAPE=(--device cuda --layers 16 --hidden 2048 --ffn 5632 --heads 16 --vocab 32000 --seq 2048
       --timed-steps 3)
{
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
  python -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
  timeout 200 python benchmarks/memory_rl.py "${SHAPE[@]}"
  if python -c "import transformer_engine as te; print('transformer_engine', te.__version__)"; then
    timeout 200 python benchmarks/memory_rl.py "${SHAPE[@]}" --fp8 hybrid
  else
    echo "transformer_engine not importable: no FP8 run"
  fi
} 2>&1 | tee "$RESULTS"
