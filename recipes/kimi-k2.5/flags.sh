# shellcheck shell=bash disable=SC2034  # every variable here is read by the script sourcing it
# Kimi-K2.5: every stage's flags, in one place. Sourced by pipeline.sh beside it (the one
# pipeline every recipe shares) and by tests/test_kimi_recipe.py, which runs every stage on CPU
# with exactly these arrays against the Kimi-shaped stand-in (tests/support/kimi_standin.py), setting
# only the size and device-count knobs below (and the transformers backend / the reference
# evaluator where vLLM on CPU cannot do the GPU run's part: see RESOURCES.md).
#
# Why tensor parallel 8: the INT4 checkpoint is 594 GB (`eagle3-extract plan` on the config:
# 571 GB of routed experts at 4 bits + bf16 scales per 32, the rest bf16), 74 GB per GPU at TP 8.
# That fits an H200 (141 GB, ~62 GB left for the KV cache); on an 80 GB H100 only ~3 GB would be
# left, so the plan step flags 8xH100 as tight and the recipe targets 8xH200. One engine uses
# the whole node: regeneration, extraction and evaluation run one after the other.
RECIPE_NAME=kimi-k2.5
HUB_ID=moonshotai/Kimi-K2.5  # what `huggingface-cli download` fetches into $MODEL (incl. its .py files)

# ---- knobs (environment): sizes and device counts only ----
NGPU="${NGPU:-8}"                          # GPUs of the node, all serving one TP engine
# train.yaml's lrs are set for PLANNED_GPUS x max_tokens_per_batch x gradient_accumulation_steps
# tokens per step: pipeline.sh keeps that step on NGPU GPUs by accumulation, or refuses.
PLANNED_GPUS=8
SAMPLES="${SAMPLES:-20000}"                # conversations regenerated and trained on (seeded draw)
# Tokens kept per sample (longer ones keep their prefix). 32,768: one sample of it trains in
# ~75 GB of an H200 under ZeRO-2 (~67K would fill it), measured per token: RESOURCES.md "Long samples".
MAX_LENGTH="${MAX_LENGTH:-32768}"
STORAGE_DTYPE="${STORAGE_DTYPE:-fp8_e4m3}" # 57,349 B/token in bf16 -> 28,693 in fp8; no measured acceptance cost (RESOURCES.md)
CPU_WORKERS="${CPU_WORKERS:-16}"           # tokenizer processes
PROMPTS="${PROMPTS:-128}"                  # held-out prompts for the vLLM acceptance measurement
GPU_MEMORY_GIB="${GPU_MEMORY_GIB:-141}"    # one GPU's memory: H200

# The tokenizer is Python code shipped with the model (tokenization_kimi.py, TikToken): every
# stage that loads it must be told to run it. Without the flag each stage stops before any work
# and names the file; with it the choice is recorded in the artifacts' lineage.
TRUST=(--trust-remote-code)

# ---- plan: the pipeline's first check, sizes against the node (eagle3-extract plan) ----
PLAN_ARGS=(--storage-dtype "$STORAGE_DTYPE" --tensor-parallel-size "$NGPU" --gpus "$NGPU"
  --gpu-memory-gib "$GPU_MEMORY_GIB" --max-model-len $((MAX_LENGTH + 1)))

# ---- regenerate: one `vllm serve` over the node (TP = NGPU), text only ----
# The mode mix Kimi's users serve: thinking is K2.5's default (instant needs
# chat_template_kwargs thinking=false, and vLLM's kimi_k2 reasoning parser reads
# `thinking = chat_kwargs.get("thinking", True)`), and its users run it as an agent. So 3 rows in 4
# are regenerated in thinking mode (--thinking-fraction 0.75, drawn per row by a seeded hash of
# its id) and 1 in 4 in instant mode. Measured on the agent target (recipes/tiny-agent,
# docs/benchmarks/traffic-mix.md; tools/bench/bench_traffic_mix.sh, vLLM, k = 3, greedy, 150 steps, means of
# seeds 0-2, AL on instant / thinking / agent traffic):
#   (a) instant rows only        3.158 / 1.180 / 1.099
#   (b) thinking + agent only    1.073 / 2.898 / 2.607
#   (c) mix, 30 % instant rows   1.740 / 2.977 / 2.428   (k = 5: 1.747 / 3.480 / 2.624)
# A draft trained on one mode accepts almost nothing on the other, so the mix keeps both. (c)
# is best on thinking and over all prompts; it trails (b) on agent by 7 % and (a) on instant by
# 45 %. At 600 steps (seed 0) it leads (b) on agent too and trails (a) on instant by 11 %. No mix
# met "best on each kind", so the served share decides: with thinking and agent served alike,
# (c) is ahead of (b) once instant is >= 7 % of requests, and ahead of (a) unless instant is more
# than half of them. 0.75 thinking is (c)'s 30 % instant, rounded to Kimi's
# default-thinking traffic; set 1.0 only where no instant request is served.
# Tool data: agent rows are rows that declare tools (the source's `tools`, OpenAI format, and its
# tool results); give the data as many agent loops as the served traffic has (the measured mix
# had 40 %), with their tool results (spliced under the target's own call ids when regenerated):
# a draft that never saw a tool call reads agent traffic at ~1.1.
# The reasoning and tool-call parsers return `reasoning_content` and `tool_calls`, which
# regenerate keeps with vLLM's token ids (the prompt as served, the completion with <think>,
# </think> and the tool-call markers), and tokenize trains one sample per generation event
# (Kimi's template drops every earlier turn's reasoning, so a whole conversation never shows it).
# Tools declared in the data are sent with each request; the source's tool results are spliced
# under the target's call ids.
SERVE_ARGS=(--tensor-parallel-size "$NGPU" "${TRUST[@]}" --language-model-only
  --reasoning-parser kimi_k2 --enable-auto-tool-choice --tool-call-parser kimi_k2
  --max-model-len 32768 --gpu-memory-utilization 0.9)
# Moonshot's recommended sampling (temperature 0.6, top-p 0.95). --max-tokens 16384: Moonshot
# asks for max_tokens >= 16,000 in thinking mode, since reasoning alone often runs to thousands
# of tokens; an answer cut there is rejected (not trained half-finished) and counted. 16,384
# plus a prompt of up to 16,384 fits the server's 32,768 context and MAX_LENGTH, so no sample is
# cut by tokenize either.
REGENERATE_ARGS=(--temperature 0.6 --top-p 0.95 --max-tokens 16384 --seed 0
  --thinking-fraction 0.75 --concurrency 256 --limit "$SAMPLES" --sample-seed 0)

# ---- tokenize + vocab ----
TOKENIZE_ARGS=(--max-length "$MAX_LENGTH" --workers "$CPU_WORKERS" "${TRUST[@]}")
# 32,000 of 163,840 ids: cuts the draft's LM head 5x (229M instead of 1.17G weights at H 7168).
# The vocab step prints the coverage measured on the regenerated answers: below ~0.99, raise it.
VOCAB_ARGS=(--draft-vocab-size 32000)

# ---- extract: one vLLM worker with TP = NGPU (--rank/--world-size added by pipeline.sh) ----
# The model needs the whole node, so one worker; several nodes: one worker per node
# (--rank/--world-size) and `eagle3-extract merge`. bf16 compute (the served model's), fp8 storage.
EXTRACT_WORKERS=1
EXTRACT_ARGS=(--backend vllm --tensor-parallel-size "$NGPU" "${TRUST[@]}"
  --storage-dtype "$STORAGE_DTYPE" --max-model-len $((MAX_LENGTH + 1)) --gpu-memory-utilization 0.9)
# transformers cannot run the INT4 routed experts (the transformers backend refuses them), so
# there is no float32 reference to recompute samples with on this node; the capture path is
# instead proven on the stand-in in CI (vLLM vs transformers, tests/test_kimi_recipe.py).
VERIFY_ARGS=()
VERIFY_SKIPPED="Kimi-K2.5's INT4 experts do not run in transformers; vLLM's capture of this wrapper is checked against transformers on the Kimi-shaped stand-in in CI"

# ---- train: accelerate launch, DeepSpeed ZeRO-2 over the node ----
# A Llama-style draft at hidden 7168: 1,058.8M trainable parameters with the 32k head; fp32
# weights + gradients + Adam = 16 B/param, ~17 GB before ZeRO-2 shards it 8 ways (RESOURCES.md).
TRAIN_CONFIG="recipes/$RECIPE_NAME/train.yaml"
ACCELERATE_ARGS=(--config_file recipes/accelerate/zero2.yaml --num_processes "$NGPU")

# ---- eval: vLLM speculative decoding, k = 3, greedy, per kind of traffic ----
# Prompts are rendered as served: a held-out row that declares tools is agent traffic (its tools
# and tool results rendered), any other in its own mode, else in K2.5's default, thinking, the
# traffic its users serve most. The report gives acceptance per kind (instant / thinking /
# agent) beside the whole set; add `--chat-template-kwarg thinking=false` to read instant mode.
EVAL_ARGS=(--k 3 --temperature 0 --max-new-tokens 512 --max-prompt-tokens 4096
  --limit "$PROMPTS" --concurrency 16 "${TRUST[@]}"
  --engine-arg dtype=bfloat16 --engine-arg enforce_eager=false --engine-arg language_model_only=true
  --engine-arg tensor_parallel_size="$NGPU" --engine-arg gpu_memory_utilization=0.85
  --engine-arg max_model_len=8192)
