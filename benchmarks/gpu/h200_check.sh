#!/usr/bin/env bash
# GPU check on one H200 (or H100), self-contained, < 8 minutes (BUDGET_S, default 450 s).
# What runs on any CUDA machine with torch and megatron-core runs first; what needs more is
# recorded as "not available: <reason>" (not a failure) where it cannot run. The sections,
# in the order they run (`bash benchmarks/gpu/h200_check.sh plan` prints them with their
# limits and stops):
#   environment: GPU, torch/CUDA, which packages import, and the device memory at start:
#      torch.cuda.mem_get_info (free and total), memory/free_bytes, memory/reserved_bytes.
#   tokenizer: a sentencepiece model of 512 pieces for the RL runs (tools/train_tokenizer.py;
#      about a second, limit 30 s).
#   rl_fp8 (flagship, only where Transformer Engine and flash-attn import): the RL run below
#      with FP8 (--fp8-format hybrid --fp8-recipe tensorwise; compute capability >= 8.9) and
#      Megatron-Core's dynamic engine, as the 27B example: first, never left to a spent budget.
#   decode: ms per decode step of the static engine on the RL policy's shape at batch 8 and
#      64 against the HBM floor (weights + KV read per step at 4800 GB/s), tokens/s, host
#      syncs per step and the KV cache's bytes measured on the engine's buffers
#      (benchmarks/decode_step.py; each batch size's row printed as it finishes).
#   memory_bf16: one RL step's peak memory (torch.cuda.max_memory_allocated), dense Adam
#      against LoGRA inside Megatron's distributed optimizer (benchmarks/memory_rl.py):
#      dense Adam and the backward sketch (--loggra-sketch backward) first, then the gradient
#      sketch, each row printed as it finishes, so a timeout still leaves the key rows.
#   rl_static: pretrain_rl.py for a few RL steps on a ~1B Llama-style policy made from
#      scratch (TP=1, 20 layers, hidden 2048, the tokenizer above), bf16, full recompute, the
#      static engine (Transformer Engine's layers when importable, else --transformer-impl
#      local), LoGRA's backward sketch (--optimizer loggra --loggra-sketch backward, as the
#      examples; every RL run here uses it). Per step: step/rollout/train times,
#      throughputs, peak, reserved and free memory, KV-cache, optimizer-state, grad-buffer and
#      sketch-buffer bytes, after tools/estimate_memory.py's estimate of the same flags
#      (section estimate_rl_static).
#   kl_control: benchmarks/bench_kl_control.py at hidden 2048, seq 1024 (predicted-KL control
#      per update, probe skipping, honesty).
#   rl_dynamic: the RL run with Megatron-Core's dynamic engine (needs flash-attn).
#   memory_fp8, rl_fp8: the memory sweep, and the RL run where flash-attn is missing, with
#      FP8 (needs Transformer Engine and compute capability >= 8.9).
#   rl_fp8_rollout: rl_fp8's run with --rollout-fp8 (FP8 decode steps, eager) against rl_fp8's
#      default (bf16 decode steps in CUDA graphs): which rollout is faster on this GPU.
#   rl_packed: rl_static's run with --sequence-packing (Transformer Engine's THD attention):
#      tokens/s and peak memory against rl_static's.
# Limits: the budget less the environment's 60 s is shared among the sections that can run,
# in the order above: a section joins while the weights so far fit (a weight is about the
# seconds it takes on one H200 with a margin: tokenizer 30, decode 60, memory 130, an RL run
# 170 with its estimate, kl_control 90); the rest are SKIPPED with the reason. At 450 s a
# machine without Transformer Engine or flash-attn runs everything but kl_control (measured
# before: docs/benchmarks.md); BUDGET_S=1400 runs every section. What a section leaves
# unused passes to the next (its timeout is what is left of the budget less what the later
# sections reserve).
# Every number goes to ONE file, ${RESULTS:-${OUT:-.}/h200_check.txt}; each section runs
# under `timeout` within the budget, so a failure or a hang loses only that section.
#
# Via the device tool (its H200 has torch, sentencepiece and transformers, but neither
# megatron-core nor Transformer Engine nor flash-attn, and no network):
#   here, once:  echo /.whl/ >> .git/info/exclude
#                bash benchmarks/gpu/h200_check.sh fetch-wheels   # megatron-core -> .whl/
#   then:        run(command="bash benchmarks/gpu/h200_check.sh", carry=[".whl"],
#                    timeout_s=540)            # $OUT/h200_check.txt comes back
#   Transformer Engine and flash-attn cannot travel that way (TE's core wheel is ~171 MiB,
#   over the 64 MiB a call carries; neither has a binary wheel of its torch extension), so
#   there rl_dynamic, memory_fp8, rl_fp8 and rl_packed record why they are not available.
# By hand, on any CUDA machine, e.g. in docker/Dockerfile's image (TE and flash-attn
# included, every section runs; give it the time):
#   BUDGET_S=1400 bash benchmarks/gpu/h200_check.sh           # -> ./h200_check.txt
#   RESULTS=/tmp/r.txt BUDGET_S=1400 STEPS=5 bash benchmarks/gpu/h200_check.sh
#   SKIP="memory_bf16" bash benchmarks/gpu/h200_check.sh     # sections by name, e.g. a rerun
set -uo pipefail  # no -e: a failing section is recorded and the next one runs
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python

if [ "${1:-}" = fetch-wheels ]; then  # on a machine with PyPI: the wheels the device lacks
    MCORE=$(sed -n 's/^ARG MEGATRON_CORE_VERSION=\(.*\)$/\1/p' docker/Dockerfile)
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        "megatron-core==${MCORE:?no MEGATRON_CORE_VERSION in docker/Dockerfile}"
fi

RESULTS=${RESULTS:-${OUT:-.}/h200_check.txt}
BUDGET_S=${BUDGET_S:-450}
STEPS=${STEPS:-3}
# For a rehearsal on CPU (tests/integration/test_gpu_scripts.py): RL_DEVICE=cpu, and flags appended to
# the pretrain_rl/estimate calls (RL_EXTRA), the memory_rl calls (MEM_EXTRA) and the
# bench_kl_control call (KL_EXTRA) and the decode_step call (DECODE_EXTRA).
RL_DEVICE=${RL_DEVICE:-cuda}
read -ra RL_EXTRA <<<"${RL_EXTRA:-}"
read -ra MEM_EXTRA <<<"${MEM_EXTRA:-}"
read -ra KL_EXTRA <<<"${KL_EXTRA:-}"
read -ra DECODE_EXTRA <<<"${DECODE_EXTRA:-}"
WORK=${WORK:-$(mktemp -d /tmp/h200_check.XXXXXX)}
mkdir -p "$WORK/logs" "$(dirname "$RESULTS")"
: >"$RESULTS"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The launch scripts' allocator and NCCL settings (examples/h100_8gpu, docs/memory.md): a
# freed KV buffer's pages are reused instead of its segment staying pinned, and no NVLS
# buffers (one GPU here: no communicator either way). The estimates below say so too.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0
# CUDA graphs beside expandable segments: NCCL's buffer registration off (rollout/dynamic/mcore_engine.py)
export NCCL_GRAPH_REGISTER=0
# Setup: carried wheels (megatron-core) into a private site dir; this repository by path.
SITE=$WORK/site
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl >>"$WORK/logs/setup.log" 2>&1 \
        || echo "setup: pip install of .whl/ failed (see below)" >>"$RESULTS"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"

note() { echo "$*" | tee -a "$RESULTS"; }

# section NAME LIMIT_S CMD...: CMD under `timeout` (at least LIMIT_S plus what the sections
# before it left unused, at most what is left of BUDGET_S), its output in
# $WORK/logs/NAME.log; the tail of that log goes to RESULTS when CMD fails.
ORDER=()           # the sections that share the budget, in the order they run (the plan)
declare -A LIMIT=() # their limits
section() {
    local name=$1 limit=$2 left rc t0 n after=0 found=""
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        note "## $name: SKIPPED (SKIP)"
        return 1
    fi
    if ((limit <= 0)); then
        note "## $name: SKIPPED (not within the ${BUDGET_S} s budget: raise BUDGET_S)"
        return 1
    fi
    left=$((BUDGET_S - SECONDS))
    if ((left < 30)); then
        note "## $name: SKIPPED (the ${BUDGET_S} s budget is spent)"
        return 1
    fi
    # what the sections before this one left unused is this one's too: its timeout is what is
    # left of the budget less what the sections after it reserve, at least its own limit
    for n in "${ORDER[@]}"; do
        [ -n "$found" ] && after=$((after + LIMIT[$n]))
        [ "$n" = "$name" ] && found=1
    done
    [ -n "$found" ] && ((left - after > limit)) && limit=$((left - after))
    ((limit > left)) && limit=$left
    note "## $name (timeout ${limit} s)"
    t0=$SECONDS
    timeout --kill-after=20 "$limit" "$@" >"$WORK/logs/$name.log" 2>&1
    rc=$?
    if ((rc != 0)); then
        note "FAILED rc=$rc$( ((rc == 124)) && echo ' (timed out)'); last lines of its log:"
        grep -v -i 'warn' "$WORK/logs/$name.log" | tail -n 60 >>"$RESULTS"
    fi
    note "-> rc=$rc in $((SECONDS - t0)) s"
    return $rc
}

note "# h200_check $(date -u +%FT%TZ) budget ${BUDGET_S} s, ${STEPS} RL steps per run"
ENV_LIMIT=60
[ "${1:-}" = plan ] && SKIP="${SKIP:-} environment"  # plan: print the limits, run nothing
section environment "$ENV_LIMIT" "$PY" - <<'PY'
import importlib.util
import subprocess
import torch

try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout
except OSError as e:
    smi = f"(no nvidia-smi: {e})"
print("gpu", smi.strip() or "(nvidia-smi gave nothing)")
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():  # after this process's CUDA context is made
    free, total = torch.cuda.mem_get_info()
    print(f"memory at start: torch.cuda.mem_get_info free {free} B ({free / 2**30:.2f} GiB) "
          f"of {total} B ({total / 2**30:.2f} GiB) on {torch.cuda.get_device_name()} "
          f"(compute capability {torch.cuda.get_device_capability()})")
    print(f"memory at start: memory/free_bytes={free} "
          f"memory/reserved_bytes={torch.cuda.memory_reserved()} "
          f"memory/allocated_bytes={torch.cuda.memory_allocated()}")
else:
    print("memory at start: no CUDA device (no torch.cuda.mem_get_info)")
for name in ("megatron.core", "transformer_engine", "sentencepiece", "transformers", "apex",
             "flash_attn"):
    found = importlib.util.find_spec(name) is not None
    version = ""
    if found:
        try:
            version = getattr(__import__(name, fromlist=["x"]), "__version__", "")
        except Exception as e:  # noqa: BLE001 - report, do not stop
            version = f"import failed: {e}"
    print(f"{name}: {'yes ' + str(version) if found else 'no'}")
PY
grep -v -i -E 'warn|^  return ' "$WORK/logs/environment.log" >>"$RESULTS" 2>/dev/null
# One probe process (imports are most of a Python start here): whether megatron-core imports,
# why the dynamic engine / FP8 / TE layers cannot run here (an empty line: they can) and
# whether Transformer Engine imports at all; one line each.
mapfile -t PROBE < <("$PY" - "$RL_DEVICE" <<'PY' 2>/dev/null
import sys

import torch


def te_error() -> str:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"transformer_engine not importable ({type(e).__name__}: {e})"[:200]
    return ""


def why(what: str, device: str) -> str:
    if device != "cuda" or not torch.cuda.is_available():
        return f"no CUDA device (RL_DEVICE={device})"
    if what == "dynamic":
        from loggra_megatron.rollout.dynamic.generate import dynamic_engine_unavailable

        return dynamic_engine_unavailable() or ""
    if te_error() or what == "te":
        return te_error()
    cc = torch.cuda.get_device_capability()
    return "" if cc >= (8, 9) else f"FP8 needs compute capability >= 8.9, this GPU has {cc}"


def answer(fn, *args) -> str:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - e.g. megatron-core missing
        return f"its check failed ({type(e).__name__}: {e})"[:200]


def megatron_error() -> str:
    import megatron.core  # noqa: F401

    return ""


print(answer(megatron_error) and "no")
for what in ("dynamic", "fp8", "te"):
    print(answer(why, what, sys.argv[1]))
print("yes" if not te_error() else "")
PY
)
if [ "${#PROBE[@]}" -lt 5 ] || [ "${PROBE[0]}" = no ]; then
    note "megatron-core is not importable: on the device machine, run" \
        "'bash benchmarks/gpu/h200_check.sh fetch-wheels' first and carry .whl (header)"
fi
DYNAMIC_WHY=${PROBE[1]:-its check failed}
FP8_WHY=${PROBE[2]:-its check failed}
TE_WHY=${PROBE[3]:-its check failed}
if [ "${1:-}" = plan ] && [ -n "${ASSUME_AVAILABLE:-}" ]; then  # as in docker/Dockerfile's image
    DYNAMIC_WHY="" FP8_WHY="" TE_WHY=""
fi
if [ "${PROBE[4]:-}" = yes ]; then
    IMPL=(--transformer-impl transformer_engine)
else
    IMPL=(--transformer-impl local)
fi
FP8=(--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise)
not_available() { note "## $1: not available: $2"; }

# ~1.0 B parameters: 20 layers, hidden 2048, SwiGLU 5632, 16 heads / 4 KV groups, tied embeddings.
SHAPE_RL=(--num-layers 20 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
          --num-query-groups 4 --seq-length 1024 --bf16
          --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
# every RL run: LoGRA's backward sketch (LoGRA as published, the examples' mode), named here
# rather than left to the default
STEP_RL=(--prompts-per-step 8 --num-generations 8 --global-batch-size 64 --micro-batch-size 8
         --log-prob-micro-batch-size 16 --max-new-tokens 256 --inference-max-tokens 8192
         --optimizer loggra --loggra-sketch backward --loggra-rank 256 --kl-coef 0.001
         --kl-target 0.01 --kl-estimator k3)
# memory_rl.py: dense Adam and the backward sketch first, then the gradient sketch
SHAPE=(--device cuda --layers 16 --hidden 2048 --ffn 5632 --heads 16 --vocab 32000 --seq 2048
       --new-tokens 64 --rollout-rows 8 --reference yes --timed-steps 1
       --optimizers dense backward loggra)
SHAPE+=("${MEM_EXTRA[@]}")

# Section limits: BUDGET_S less the environment section's limit is shared among the sections
# that will run here (not SKIPped, not "not available"), in order of importance and in the
# order they run (the flagship FP8 + dynamic-engine run first where it can run): a section
# joins while the weights so far fit (a weight is about the seconds it takes on one H200,
# with a margin: the tokenizer 0.8 s on two CPU cores, 30; decode ~45 s estimated, 60; the
# memory sweep 100-120 s, 130; an RL run 144 s in docs/results.md section 4, 170 with its
# estimate), the rest are
# SKIPPED with the reason, and the joined ones share the whole remainder in proportion. So
# the limits add up to the budget whatever the machine can run, and section() passes what a
# section leaves unused on to the next; on a machine with Transformer Engine and flash-attn
# BUDGET_S=1400 runs every section. `bash h200_check.sh plan` prints the plan and stops
# (ASSUME_AVAILABLE=1: as on such a machine).
declare -A WEIGHT=([tokenizer]=30 [decode]=60 [rl]=170 [memory]=130 [kl_control]=90)
PLAN=(tokenizer:tokenizer)
[ -z "$FP8_WHY" ] && [ -z "$DYNAMIC_WHY" ] && PLAN+=(rl_fp8:rl)
PLAN+=(decode:decode memory_bf16:memory rl_static:rl kl_control:kl_control)
[ -z "$DYNAMIC_WHY" ] && PLAN+=(rl_dynamic:rl)
[ -z "$FP8_WHY" ] && PLAN+=(memory_fp8:memory)
[ -z "$FP8_WHY" ] && [ -n "$DYNAMIC_WHY" ] && PLAN+=(rl_fp8:rl)
[ -z "$FP8_WHY" ] && PLAN+=(rl_fp8_rollout:rl)
[ -z "$TE_WHY" ] && PLAN+=(rl_packed:rl)
REST=$((BUDGET_S - ENV_LIMIT)) USED=0 JOINED=()
for entry in "${PLAN[@]}"; do
    name=${entry%%:*} weight=${WEIGHT[${entry#*:}]}
    LIMIT[$name]=0 LIMIT[estimate_$name]=0  # 0: not within the budget (section() says so)
    [[ " ${SKIP:-} " == *" $name "* ]] && continue
    ((USED + weight <= REST)) && USED=$((USED + weight)) && JOINED+=("$entry")
done
for entry in "${JOINED[@]}"; do
    name=${entry%%:*}
    LIMIT[$name]=$((REST * WEIGHT[${entry#*:}] / USED))
    if [ "${entry#*:}" = rl ]; then  # a tenth of an RL run's share is its estimate's
        LIMIT[estimate_$name]=$((LIMIT[$name] / 10))
        LIMIT[$name]=$((LIMIT[$name] - LIMIT[estimate_$name]))
        ORDER+=("estimate_$name")
    fi
    ORDER+=("$name")
done
limits() {
    local e n
    for e in "${PLAN[@]}"; do
        n=${e%%:*}
        [ "${e#*:}" = rl ] && printf 'estimate_%s=%s ' "$n" "${LIMIT[estimate_$n]}"
        printf '%s=%s ' "$n" "${LIMIT[$n]}"
    done
}
# values FLAG ARGS...: the words after FLAG in ARGS, up to the next flag
values() {
    local flag=$1 on="" a out=()
    shift
    for a in "$@"; do
        [ -n "$on" ] && [[ $a == --* ]] && break
        [ -n "$on" ] && out+=("$a")
        [ "$a" = "$flag" ] && on=1
    done
    echo "${out[*]}"
}
LOGGRA="--optimizer $(values --optimizer "${STEP_RL[@]}") --loggra-sketch $(values --loggra-sketch "${STEP_RL[@]}")"
declare -A WHAT=(
    [tokenizer]="tools/train_tokenizer.py: sentencepiece, 512 pieces"
    [decode]="decode_step.py: ms per decode step at batch 8 and 64, a row per batch size as it finishes"
    [memory_bf16]="memory_rl.py --optimizers $(values --optimizers "${SHAPE[@]}"): one RL step's peak, a row per setting as it finishes"
    [memory_fp8]="memory_rl.py --optimizers $(values --optimizers "${SHAPE[@]}") --fp8 hybrid"
    [kl_control]="bench_kl_control.py: predicted-KL control per update at hidden 2048"
    [rl_fp8]="pretrain_rl.py, ${DYNAMIC_WHY:+static}${DYNAMIC_WHY:-dynamic} engine, FP8, $LOGGRA"
    [rl_static]="pretrain_rl.py, static engine, $LOGGRA"
    [rl_fp8_rollout]="rl_fp8 with --rollout-fp8: FP8 decode steps, eager, against rl_fp8's bf16 graphed ones"
    [rl_dynamic]="pretrain_rl.py, dynamic engine, $LOGGRA"
    [rl_packed]="pretrain_rl.py, static engine, --sequence-packing, $LOGGRA"
)
note "# section limits (s) of the ${BUDGET_S} s budget: environment=${ENV_LIMIT} $(limits)"
note "# plan, in the order the sections run (a section's unused seconds pass to the next):"
note "#   environment (${ENV_LIMIT} s): GPU, packages, torch.cuda.mem_get_info and memory/free_bytes, memory/reserved_bytes at start"
for entry in "${PLAN[@]}"; do
    name=${entry%%:*}
    if ((LIMIT[$name] > 0)); then
        cell="${LIMIT[$name]} s"
        [ "${entry#*:}" = rl ] && cell="$cell + ${LIMIT[estimate_$name]} s for its estimate"
    else
        cell="SKIPPED: not within the budget"
        [[ " ${SKIP:-} " == *" $name "* ]] && cell="SKIPPED: SKIP"
    fi
    note "#   $name ($cell): ${WHAT[$name]}"
done
[ -n "$DYNAMIC_WHY" ] && note "#   rl_dynamic: not available: $DYNAMIC_WHY"
[ -n "$FP8_WHY" ] && note "#   memory_fp8, rl_fp8, rl_fp8_rollout: not available: $FP8_WHY"
[ -n "$TE_WHY" ] && note "#   rl_packed: not available: $TE_WHY"
[ "${1:-}" = plan ] && exit 0

section tokenizer "${LIMIT[tokenizer]}" "$PY" tools/train_tokenizer.py --builtin-tasks "${TOK_TASKS:-20000}" --seed 0 \
    --vocab-size 512 --output-prefix "$WORK/tokenizer"
VOCAB=$("$PY" -c "import sentencepiece as s, sys; print(s.SentencePieceProcessor(model_file=sys.argv[1]).vocab_size())" "$WORK/tokenizer.model" 2>/dev/null || echo 512)

# rl NAME ENGINE FLAGS...: the estimate of the run's flags, a few RL steps of pretrain_rl.py,
# then the numbers of its metrics.jsonl
rl() {
    local name=$1 engine=$2 run="$WORK/$1"
    shift 2
    rm -rf "$run"
    section "estimate_${name}" "${LIMIT[estimate_${name}]}" "$PY" tools/estimate_memory.py --world-size 1 \
        --vocab-size "$VOCAB" --runtime-overhead-gb 0 --gpu-memory-gb 139 \
        --expandable-segments --no-nccl-nvls --rollout-engine "$engine" \
        "${SHAPE_RL[@]}" "$@" "${STEP_RL[@]}" "${RL_EXTRA[@]}"
    grep -v -i -E 'warn|^  return ' "$WORK/logs/estimate_${name}.log" >>"$RESULTS" 2>/dev/null
    section "$name" "${LIMIT[$name]}" "$PY" -m torch.distributed.run --nproc-per-node 1 pretrain_rl.py \
        --device "$RL_DEVICE" \
        --tokenizer-model "$WORK/tokenizer.model" --task arithmetic --num-tasks 2000 \
        "${SHAPE_RL[@]}" "$@" "${STEP_RL[@]}" "${RL_EXTRA[@]}" \
        --rollout-engine "$engine" --train-iters "$STEPS" --lr 1e-5 --output-dir "$run"
    "$PY" - "$run" >>"$RESULTS" 2>&1 <<'PY'
import sys
from loggra_megatron.metrics import read_metrics

try:
    rows = read_metrics(sys.argv[1])
except OSError:
    sys.exit(f"no metrics.jsonl in {sys.argv[1]}")
keys = ("time/step_s", "time/rollout_s", "time/train_s", "time/kl_control_s",
        "throughput/tokens_per_s", "throughput/rollout_tokens_per_s", "memory/peak_bytes",
        "memory/reserved_bytes", "memory/free_bytes", "memory/kv_cache_bytes",
        "memory/optimizer_state_bytes", "memory/grad_buffer_bytes",
        "memory/sketch_buffer_bytes", "response/length_mean", "reward/mean", "kl/step_scale")
print(f"{len(rows)} steps in metrics.jsonl")
for row in rows:
    cells = [f"{k.split('/', 1)[1]}={row[k] / 2**30:.2f}GiB" if k.startswith("memory/")
             else f"{k.split('/', 1)[1]}={row[k]:.4g}" for k in keys if k in row]
    print(f"step {row.get('step', '?')}: " + " ".join(cells))
PY
}

# the flagship first where it can run (Transformer Engine and flash-attn: the 27B example's
# FP8 GEMMs and dynamic engine), so that the budget is never spent before it
FLAGSHIP_RAN=""
if [ -z "$FP8_WHY" ] && [ -z "$DYNAMIC_WHY" ]; then
    rl rl_fp8 dynamic "${FP8[@]}"
    FLAGSHIP_RAN=1
fi
# decode steps of the policy's shape (bf16, the local spec's layers): a row per batch size
section decode "${LIMIT[decode]}" "$PY" benchmarks/decode_step.py --device "$RL_DEVICE" --bf16 --layers 20 \
    --hidden 2048 --ffn 5632 --heads 16 --groups 4 --vocab 32000 --prompt-tokens 768 \
    --new-tokens 64 --batches 8 64 --repeats 3 "${DECODE_EXTRA[@]}"
grep -E '^(decode|\|)' "$WORK/logs/decode.log" >>"$RESULTS" 2>/dev/null

# what runs wherever torch and megatron-core do: the memory sweep (dense Adam and the backward
# sketch first, a row per setting as it finishes), then the RL run with the backward sketch
section memory_bf16 "${LIMIT[memory_bf16]}" "$PY" benchmarks/memory_rl.py "${SHAPE[@]}"
grep -E '^(#|\||$)' "$WORK/logs/memory_bf16.log" >>"$RESULTS" 2>/dev/null
rl rl_static static "${IMPL[@]}"
# predicted-KL control per update at LLM width: probing every update against probe
# skipping (interleaved repeats), then predicted vs realized KL at an RL-scale lr (the
# benchmark's 3e-3 moves this model by ~0.75 nats per update, far outside the quadratic model)
section kl_control "${LIMIT[kl_control]}" "$PY" -m torch.distributed.run --nproc-per-node 1 \
    benchmarks/bench_kl_control.py --device "$RL_DEVICE" --layers 8 --hidden 2048 --heads 16 \
    --vocab 32000 --seq 1024 --batch 16 --lr 1e-4 --steps 10 --run-steps 20 --repeats 3 \
    --skipping-only \
    "${KL_EXTRA[@]}"
grep -E '^(#|\||baseline|Probe|predicted|skipped)' "$WORK/logs/kl_control.log" >>"$RESULTS" 2>/dev/null
# the dynamic engine (flash-attn) and FP8 (Transformer Engine on Hopper)
if [ -z "$DYNAMIC_WHY" ]; then
    rl rl_dynamic dynamic "${IMPL[@]}"
else
    not_available rl_dynamic "$DYNAMIC_WHY"
fi
if [ -z "$FP8_WHY" ]; then
    section memory_fp8 "${LIMIT[memory_fp8]}" "$PY" benchmarks/memory_rl.py "${SHAPE[@]}" --fp8 hybrid
    grep -E '^(#|\||$)' "$WORK/logs/memory_fp8.log" >>"$RESULTS" 2>/dev/null
    [ -n "$FLAGSHIP_RAN" ] || rl rl_fp8 static "${FP8[@]}"  # without flash-attn: static
    # rl_fp8's run with FP8 rollouts (eager decode steps) against its bf16 ones (graphed)
    rl rl_fp8_rollout "${DYNAMIC_WHY:+static}${DYNAMIC_WHY:-dynamic}" "${FP8[@]}" --rollout-fp8
else
    not_available memory_fp8 "$FP8_WHY"
    not_available rl_fp8 "$FP8_WHY"
    not_available rl_fp8_rollout "$FP8_WHY"
fi
# packed sequences (Transformer Engine's THD attention), rl_static's flags otherwise
if [ -z "$TE_WHY" ]; then
    rl rl_packed static --transformer-impl transformer_engine --sequence-packing
else
    not_available rl_packed "$TE_WHY"
fi
note "# done in ${SECONDS} s; logs in $WORK/logs"
