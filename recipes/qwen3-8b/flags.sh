# shellcheck shell=bash disable=SC2034  # every variable here is read by the script sourcing it
# Qwen3-8B: every stage's flags, in one place. Sourced by pipeline.sh beside it and by
# tests/test_recipes.py, which runs the stages' CPU preflights with exactly these arrays on a
# scaled-down Qwen3 (setting only the size and device-count knobs, and --backend hf for
# --backend vllm). Change a flag here or in recipes/dense-flags.sh (what the 8B recipes share),
# never in pipeline.sh.
#
# Why one GPU node and tensor parallel 1: the target is 8.19e9 parameters, 16.4 GB in bf16, so
# every stage fits one 80 GB GPU with room for its KV cache (RESOURCES.md). Tensor parallelism
# would only add an all-reduce per layer; the node's GPUs are used data-parallel instead. NGPU=1
# runs the same recipe on a single GPU, about 8 times slower: pipeline.sh accumulates 8
# micro-batches per step there, so a step keeps train.yaml's 65,536 tokens and its lrs hold
# (an NGPU that cannot keep it, e.g. 3 or 16, is refused, naming the change).
RECIPE_NAME=qwen3-8b
HUB_ID=Qwen/Qwen3-8B  # what `huggingface-cli download` fetches into $MODEL

SAMPLES="${SAMPLES:-20000}"                # conversations regenerated and trained on (seeded draw)
MAX_LENGTH="${MAX_LENGTH:-8192}"           # thinking answers are long: a 6,144-token answer + its prompt
CONTEXT=40960                              # the model's own context, for `vllm serve`
# Qwen3's parsers on the server: `--reasoning-parser qwen3` returns the reasoning in
# `reasoning_content` (no longer left inside `content`), `--tool-call-parser hermes` its
# <tool_call> blocks as `tool_calls`; regenerate keeps both with vLLM's token ids, and tokenize
# trains each generation event's completion ids (<think> block, tool calls and <|im_end|>) after
# the prompt as served. Thinking is Qwen3's default mode (enable_thinking=true) and what its
# users mostly serve; 1 row in 4 is regenerated in non-thinking mode, the documented switch
# (--thinking-fraction 0.75: the mix measured on the agent target, as the Kimi recipe's flags.sh
# shows).
# Qwen's recommended thinking sampling (temperature 0.6, top-p 0.95; greedy decoding makes
# thinking loop). --max-tokens 6144: Qwen3's thinking answers on chat data mostly end well within
# it, and 6,144 + a 2,048-token prompt is MAX_LENGTH; an answer cut there is rejected and counted.
# Eval stays greedy, vLLM's reference figure: thinking may loop under it, which still measures
# acceptance.
SAMPLING=(--temperature 0.6 --top-p 0.95 --max-tokens 6144)
# 32,000 of 151,936 ids (151,669 used by the tokenizer): the size of the published EAGLE-3
# drafts for Qwen3-8B; it cuts the draft's LM head 4.7x (131M instead of 622M weights, the
# largest tensor it computes each TTT step), and the most frequent answer tokens are expected to
# cover nearly all answer positions. The vocab step prints the coverage measured on the real
# data: below ~0.99, raise the size (acceptance is capped by coverage).
VOCAB_ARGS=(--draft-vocab-size 32000)

# shellcheck source=recipes/dense-flags.sh
source recipes/dense-flags.sh  # the rest (run from the repository root, as pipeline.sh is)
SERVE_ARGS+=(--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes)
REGENERATE_ARGS+=(--thinking-fraction 0.75)
