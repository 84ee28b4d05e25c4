#!/usr/bin/env bash
# The whole pipeline on the embedded tiny target, on CPU:
#   chat data → tokenized samples + draft vocabulary → hidden states → EAGLE-3 draft → acceptance.
#
#   bash recipes/tiny/pipeline.sh [OUT_DIR]          (default runs/tiny)
#
# SAMPLES (training conversations to extract, default 800) and STEPS (optimizer steps, default
# 150) keep the demo to minutes on 2 CPU cores; SAMPLES=all STEPS=0 uses everything and the
# recipe's epochs (tens of minutes).
#
# Every stage validates its inputs and lineage before it runs and its output before it
# reports success; rerunning resumes where a stage left off or stops on an existing artifact.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-runs/tiny}"
samples="${SAMPLES:-800}"
steps="${STEPS:-150}"
limit=(); [ "$samples" = all ] || limit=(--max-samples "$samples")
max_steps=(); [ "$steps" = 0 ] || max_steps=(--max-steps "$steps")
target=recipes/tiny/target
mkdir -p "$out"

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

step "data: the corpus (Python stdlib functions as conversations; held out by source file)"
[ -f "$out/corpus.jsonl" ] || uv run tools/build_tiny_target.py --corpus-only "$out/corpus.jsonl"
for split in train heldout; do
  [ -f "$out/$split.conversations.parquet" ] || uv run eagle3-data ingest "$out/corpus.jsonl" --keep "split=$split" --out "$out/$split.conversations.parquet"
  [ -f "$out/$split.tokenized.parquet" ] || uv run eagle3-data tokenize "$out/$split.conversations.parquet" --tokenizer "$target" --max-length 512 --out "$out/$split.tokenized.parquet"
done
[ -f "$out/vocab_map.safetensors" ] || uv run eagle3-data vocab "$out/train.tokenized.parquet" --draft-vocab-size 2048 --out "$out/vocab_map.safetensors"

step "extract: hidden states of the target (transformers backend on CPU; --backend vllm on GPUs)"
[ -d "$out/hidden_states" ] || uv run eagle3-extract run --model "$target" --tokenized "$out/train.tokenized.parquet" --out "$out/hidden_states" "${limit[@]}"
[ -d "$out/heldout_hidden_states" ] || uv run eagle3-extract run --model "$target" --tokenized "$out/heldout.tokenized.parquet" --out "$out/heldout_hidden_states" --max-samples 64

step "train: the draft (single process; see recipes/accelerate/ for DDP and ZeRO)"
uv run accelerate launch --config_file recipes/accelerate/single.yaml -m eagle3_train --config recipes/tiny/train.yaml \
  --output-dir "$out/train" --set data.hidden_states="$out/hidden_states" --set data.vocab_map="$out/vocab_map.safetensors" \
  "${max_steps[@]}"

step "eval: acceptance length (offline on held-out states; reference speculative decoding)"
draft="$out/train/draft"
uv run eagle3-eval offline --draft "$draft" --hidden-states "$out/heldout_hidden_states" --out "$out/eval-offline"
uv run eagle3-eval reference --draft "$draft" --target "$target" --prompts "$out/corpus.jsonl" \
  --heldout-sources "$target/build_info.json" --limit 24 --max-new-tokens 96 --threads 1 --out "$out/eval-reference"
uv run eagle3-eval compare "$out/eval-offline" "$out/eval-reference"
