#!/usr/bin/env bash
# Train a Hugging Face model with GRPO + LoGRA, end to end, offline, on 2 CPU processes:
#   1. make a tiny Qwen2-style HF model directory (byte-level BPE tokenizer with Qwen's chat
#      template and stop ids) and a Parquet math dataset with chat-message prompts,
#   2. convert it to a Megatron checkpoint (tools/convert_checkpoint.py),
#   3. GRPO with LoGRA on the math task (math-verify answers, chat template, held-out eval),
#   4. convert the trained policy back to Hugging Face and generate with transformers.
# Usage: bash examples/hf_model/run.sh [OUT_DIR] [extra pretrain_rl.py flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/hf_model}
shift || true

python examples/hf_model/make_tiny_model.py --out "$OUT"
[ -d "$OUT/mcore" ] || python tools/convert_checkpoint.py --direction hf-to-megatron \
    --load "$OUT/hf" --save "$OUT/mcore"

LOAD="$OUT/mcore"  # a relaunch resumes the run
[ -f "$OUT/run/latest_checkpointed_iteration.txt" ] && LOAD="$OUT/run"
torchrun --nproc-per-node 2 pretrain_rl.py \
    --load "$LOAD" --save "$OUT/run" --tokenizer-model "$OUT/hf" \
    --task math --data-path "$OUT/data/train.parquet" \
    --eval-data-path "$OUT/data/eval.parquet" --eval-interval 5 \
    --seq-length 128 --max-new-tokens 48 --sft-iters 150 --sft-lr 3e-3 \
    --prompts-per-step 8 --num-generations 4 --global-batch-size 16 --micro-batch-size 8 \
    --train-iters 10 --lr 1e-4 --optimizer loggra --loggra-rank 8 "$@"

rm -rf "$OUT/hf_out"
python tools/convert_checkpoint.py --direction megatron-to-hf --load "$OUT/run" --save "$OUT/hf_out"
cp "$OUT"/hf/{tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} \
    "$OUT/hf_out/"
python - "$OUT/hf_out" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(path).eval()
prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                 add_generation_prompt=True, tokenize=False)
ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
out = model.generate(ids, max_new_tokens=40, do_sample=False)
print("transformers generates:", repr(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
PY
