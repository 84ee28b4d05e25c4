#!/usr/bin/env bash
# An EAGLE-3 draft for a real target on one GPU node, measured by vLLM:
#   sizes checked (disk, GPU memory, parallelism) → chat data → the target's own answers
#   (`vllm serve`) → tokenized samples + 32k draft vocabulary → hidden states (vLLM backend,
#   EXTRACT_WORKERS workers of NGPU/EXTRACT_WORKERS GPUs each, merged, verified) → draft
#   (`accelerate launch`) → acceptance length and speedup from vLLM speculative decoding.
#
#   MODEL=models/Llama-3.1-8B-Instruct DATA="sharegpt.jsonl ultrachat.jsonl" HELDOUT=heldout.jsonl \
#     bash recipes/llama-3.1-8b/pipeline.sh [OUT_DIR]          (default runs/<recipe>)
#   MODEL=models/Qwen3-8B DATA=... HELDOUT=... bash recipes/qwen3-8b/pipeline.sh
#   MODEL=models/Kimi-K2.5 DATA=... HELDOUT=... bash recipes/kimi-k2.5/pipeline.sh
#
# A recipe planned for several nodes (`eagle3-recipe new --nodes N`, docs/multinode.md) runs this
# same script on every node, OUT_DIR on a filesystem they share and NODE_RANK / MASTER_ADDR set:
# node 0 prepares the data, every node extracts its ranks and trains, node 0 merges and evaluates.
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 MODEL=... DATA=... HELDOUT=... bash recipes/<name>/pipeline.sh /shared/run
#
# MODEL: the target's local directory (`huggingface-cli download <HUB_ID> --local-dir ...`; this
# script never downloads a model). DATA: chat files to train on (ShareGPT / OpenAI messages JSONL,
# Parquet, `datasets` dirs); HELDOUT: other files, whose prompts only the evaluation sees.
# Knobs: those of flags.sh (NGPU, SAMPLES, MAX_LENGTH, STORAGE_DTYPE, ...), REGENERATE=0 to train
# on the corpus answers as written, MAX_STEPS to cap training, PORT for `vllm serve` (8000).
#
# This one file serves every recipe (the others link to it): what differs lives in flags.sh
# (every stage's flags, the extraction layout, whether verify can run) and train.yaml beside it. GPU memory, disk and time per stage:
# RESOURCES.md. Every stage checks its inputs and lineage first; a rerun resumes or reuses what
# is complete.
set -euo pipefail
recipe_dir="$(cd "$(dirname "$0")" && pwd)"
cd "$recipe_dir/../.."
recipe="recipes/$(basename "$recipe_dir")"
NODES=1  # a multi-node recipe's flags.sh sets NODES, NODE_RANK and MASTER_ADDR
# shellcheck source-path=SCRIPTDIR source=flags.sh
source "$recipe/flags.sh"
node_rank=0
[ "$NODES" = 1 ] || node_rank="$NODE_RANK"
[ "$node_rank" -ge 0 ] && [ "$node_rank" -lt "$NODES" ] ||
  { echo "NODE_RANK=$node_rank: this recipe runs on nodes 0 .. $((NODES - 1))" >&2; exit 2; }
out="${1:-runs/$RECIPE_NAME}"
: "${MODEL:?set MODEL to the target model directory (huggingface-cli download $HUB_ID --local-dir ...)}"
: "${DATA:?set DATA to the chat files to train on (space-separated)}"
: "${HELDOUT:?set HELDOUT to chat files kept for evaluation only (space-separated)}"
read -r -a data_files <<<"$DATA"
read -r -a heldout_files <<<"$HELDOUT"
regenerate="${REGENERATE:-1}"
port="${PORT:-8000}"
mkdir -p "$out"
# Subprocesses import torch/transformers many times: let them cache bytecode. Never the hub.
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
# Another node's output, on the shared OUT_DIR: every stage writes its files and folders whole
# (a temporary name, then a rename), so one that exists is complete.
await() {
  [ -e "$1" ] || echo "node $node_rank: waiting for $1 ($2)"
  until [ -e "$1" ]; do sleep "${AWAIT_SECONDS:-30}"; done
}
began=$(date +%s)

step "setup: the workspace with vLLM (CUDA build, from uv.lock)"
uv sync --frozen --all-packages --extra vllm
bin="$(uv run --frozen --no-sync python -c 'import os, sys; print(os.path.dirname(sys.executable))')"
# MODEL must be the recipe's target: its layer count fixes the aux layer ids, its sizes the sheet.
"$bin/python" recipes/recipe_targets.py check "$recipe" "$MODEL"
aux="$("$bin/python" recipes/recipe_targets.py aux-ids "$recipe")"  # train.yaml's, e.g. 2,16,29
# train.yaml's lrs hold for its tokens per step: on NGPU GPUs accumulation keeps it, or this stops.
accumulation="$("$bin/python" recipes/recipe_targets.py accumulation "$recipe" "$PLANNED_GPUS" "$((NGPU * NODES))")"
echo "target $MODEL matches $recipe/target_config.json; aux layer ids $aux; $NGPU GPU(s) x" \
  "$NODES node(s), $accumulation micro-batch(es) per step"

step "plan: disk for the hidden states, GPU memory and parallelism, from the target's config"
# SAMPLES x MAX_LENGTH bounds the tokens from above (samples are cut at MAX_LENGTH): a bound
# over the free disk is a warning here; extract's preflight checks the exact count.
"$bin/eagle3-extract" plan --model "$MODEL" --aux-layer-ids "$aux" --samples "$SAMPLES" \
  --max-tokens-per-sample "$MAX_LENGTH" "${PLAN_ARGS[@]}" --out "$out/hidden_states" \
  --json "$out/plan.json"

if [ "$node_rank" != 0 ]; then
  step "data: node 0 prepares it (regenerate, tokenize, vocab)"
  await "$out/train.tokenized.parquet" "node 0's tokenize"
  await "$out/vocab_map.safetensors" "node 0's vocab step"
else
  step "data: ingest (training files and held-out files apart)"
  for f in "${heldout_files[@]}"; do
    for g in "${data_files[@]}"; do
      [ "$(basename "$f")" != "$(basename "$g")" ] || { echo "$f is both DATA and HELDOUT" >&2; exit 2; }
    done
  done
  [ -f "$out/train.conversations.parquet" ] || "$bin/eagle3-data" ingest "${data_files[@]}" \
    --out "$out/train.conversations.parquet"
  [ -f "$out/heldout.conversations.parquet" ] || "$bin/eagle3-data" ingest "${heldout_files[@]}" \
    --out "$out/heldout.conversations.parquet"
  # eagle3-eval takes prompts only from rows whose source file is listed here.
  "$bin/python" -c 'import json, os, sys; print(json.dumps([os.path.basename(f) for f in sys.argv[1:]]))' \
    "${heldout_files[@]}" >"$out/heldout_sources.json"

  train_conversations="$out/train.conversations.parquet"
  if [ "$regenerate" = 1 ]; then
    step "data: the target's own answers (vllm serve, $NGPU replica(s); log $out/vllm-serve.log)"
    if [ ! -f "$out/train.regenerated.parquet" ]; then
      "$bin/vllm" serve "$MODEL" --served-model-name "$RECIPE_NAME" --port "$port" "${SERVE_ARGS[@]}" \
        >"$out/vllm-serve.log" 2>&1 &
      server=$!
      trap 'kill "$server" 2>/dev/null || true' EXIT
      "$bin/python" - "http://127.0.0.1:$port/health" "$server" <<'EOF'
import os, sys, time, urllib.request

url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 3600  # weights of every replica, CUDA graphs
while time.time() < deadline:
    try:
        urllib.request.urlopen(url, timeout=5)
        sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("vllm serve exited before it was ready: see vllm-serve.log")
        time.sleep(5)
sys.exit("vllm serve not ready after an hour: see vllm-serve.log")
EOF
      "$bin/eagle3-data" regenerate "$train_conversations" --endpoint "http://127.0.0.1:$port/v1" \
        --model "$RECIPE_NAME" "${REGENERATE_ARGS[@]}" --out "$out/train.regenerated.parquet"
      kill "$server"
      wait "$server" || true
      trap - EXIT
    fi
    train_conversations="$out/train.regenerated.parquet"
  fi

  step "data: tokenize with the target's tokenizer and chat template; the 32k draft vocabulary"
  [ -f "$out/train.tokenized.parquet" ] || "$bin/eagle3-data" tokenize "$train_conversations" \
    --tokenizer "$MODEL" "${TOKENIZE_ARGS[@]}" --out "$out/train.tokenized.parquet"
  [ -f "$out/vocab_map.safetensors" ] || "$bin/eagle3-data" vocab "$out/train.tokenized.parquet" \
    "${VOCAB_ARGS[@]}" --out "$out/vocab_map.safetensors"
fi

per_worker=$((NGPU / EXTRACT_WORKERS))
# Worker ranks over all nodes: this node runs first .. first + EXTRACT_WORKERS - 1 of world.
world=$((EXTRACT_WORKERS * NODES))
first=$((node_rank * EXTRACT_WORKERS))
step "extract: hidden states, vLLM backend, $EXTRACT_WORKERS worker(s) of $per_worker GPU(s), ranks $first .. $((first + EXTRACT_WORKERS - 1)) of $world (logs $out/extract-r*.log)"
if [ ! -d "$out/hidden_states" ]; then
  pids=()
  for ((local_rank = 0; local_rank < EXTRACT_WORKERS; local_rank++)); do
    rank=$((first + local_rank))
    [ ! -d "$out/extract/r$rank" ] || continue  # this rank finished in an earlier attempt
    devices=$(seq -s, $((local_rank * per_worker)) $((local_rank * per_worker + per_worker - 1)))
    # Each worker owns samples i with i % world == rank and checks disk and lineage before work.
    CUDA_VISIBLE_DEVICES=$devices "$bin/eagle3-extract" run \
      --model "$MODEL" --tokenized "$out/train.tokenized.parquet" --aux-layer-ids "$aux" \
      "${EXTRACT_ARGS[@]}" --rank "$rank" --world-size "$world" \
      --out "$out/extract/r$rank" >"$out/extract-r$rank.log" 2>&1 &
    pids[rank]=$!
  done
  failed=0
  for rank in "${!pids[@]}"; do
    wait "${pids[$rank]}" || { failed=1; tail -n 20 "$out/extract-r$rank.log" >&2; }
  done
  [ "$failed" = 0 ] || { echo "extraction failed (logs above); rerun to resume" >&2; exit 1; }
  if [ "$node_rank" != 0 ]; then
    await "$out/hidden_states" "node 0 merges every node's ranks"
  elif [ "$world" -gt 1 ]; then
    for ((rank = 0; rank < world; rank++)); do
      await "$out/extract/r$rank" "rank $rank's extraction"
    done
    # Shards are hard-linked: no copy. The rank datasets then only duplicate the target head.
    "$bin/eagle3-extract" merge --out "$out/hidden_states" "$out"/extract/r*
    rm -rf "$out/extract"
  else
    mv "$out/extract/r0" "$out/hidden_states"
  fi
fi
if [ "$node_rank" != 0 ]; then
  :  # node 0 verifies
elif [ -z "${VERIFY_SKIPPED:-}" ]; then
  # Recomputes a few samples with transformers (float32, CPU): catches a shifted or post-norm capture.
  "$bin/eagle3-extract" verify "$out/hidden_states" --model "$MODEL" \
    --tokenized "$out/train.tokenized.parquet" "${VERIFY_ARGS[@]}" --json "$out/hidden_states.verify.json"
else
  echo "verify skipped: $VERIFY_SKIPPED"
fi

step "train: the draft (accelerate launch ${ACCELERATE_ARGS[*]})"
[ -d "$out/train/draft" ] || "$bin/accelerate" launch "${ACCELERATE_ARGS[@]}" -m eagle3_train \
  --config "$TRAIN_CONFIG" --output-dir "$out/train" --set target.path="$MODEL" \
  --set data.hidden_states="$out/hidden_states" --set data.vocab_map="$out/vocab_map.safetensors" \
  --set train.gradient_accumulation_steps="$accumulation" ${MAX_STEPS:+--max-steps "$MAX_STEPS"}

if [ "$node_rank" != 0 ]; then
  step "done on node $node_rank: node 0 evaluates ($(( ($(date +%s) - began) / 60 )) min)"
  exit 0
fi

step "eval: vLLM speculative decoding on held-out prompts (and the target alone, for the speedup)"
[ -d "$out/eval-vllm" ] || "$bin/eagle3-eval" vllm --draft "$out/train/draft" --target "$MODEL" \
  --prompts "$out/heldout.conversations.parquet" --heldout-sources "$out/heldout_sources.json" \
  --vllm-python "$bin/python" "${EVAL_ARGS[@]}" --out "$out/eval-vllm"

step "result ($(( ($(date +%s) - began) / 60 )) min)"
"$bin/python" - "$out/eval-vllm" <<'EOF'
import json, sys
from pathlib import Path

report = Path(sys.argv[1])
r = json.loads((report / "report.json").read_text())
positions = " / ".join(f"{p:.3f}" for p in r["per_position_acceptance"])
print(f"vLLM-measured acceptance length at k={r['num_speculative_tokens']}: {r['acceptance_length']:.3f}  (per position {positions}; {r['num_prompts']} held-out prompts, greedy)")
concurrency = r.get("engine", {}).get("concurrency", 1)
print(f"speedup over the target alone: {r['speedup']:.2f}x  ({r['tokens_per_second']:.0f} vs {r['baseline_tokens_per_second']:.0f} tokens/s, {concurrency} prompts at a time)")
print(f"figure: {(report / 'acceptance.png').resolve()}")
EOF
