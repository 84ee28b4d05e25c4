# shellcheck shell=bash disable=SC2034  # every variable here is read by the script sourcing it
# Llama-3.1-8B-Instruct: every stage's flags, in one place. Sourced by pipeline.sh beside it and
# by tests/test_recipes.py, which runs the stages' CPU preflights with exactly these arrays on a
# scaled-down Llama (setting only the size and device-count knobs, and --backend hf for
# --backend vllm). Change a flag here or in recipes/dense-flags.sh (what the 8B recipes share),
# never in pipeline.sh.
#
# Why one GPU node and tensor parallel 1: the target is 8.03e9 parameters, 16.1 GB in bf16, so
# every stage fits one 80 GB GPU with room for its KV cache (RESOURCES.md). Tensor parallelism
# would only add an all-reduce per layer; the node's GPUs are used data-parallel instead. NGPU=1
# runs the same recipe on a single GPU, about 8 times slower: pipeline.sh accumulates 8
# micro-batches per step there, so a step keeps train.yaml's 65,536 tokens and its lrs hold
# (an NGPU that cannot keep it, e.g. 3 or 16, is refused, naming the change).
RECIPE_NAME=llama-3.1-8b
HUB_ID=meta-llama/Llama-3.1-8B-Instruct  # what `huggingface-cli download` fetches into $MODEL

SAMPLES="${SAMPLES:-40000}"                # conversations regenerated and trained on (seeded draw)
MAX_LENGTH="${MAX_LENGTH:-4096}"           # tokens kept per sample (longer ones keep their prefix)
CONTEXT=131072                             # the model's own context, for `vllm serve`
# Sampling of the model's generation_config.json (temperature 0.6, top-p 0.9): the answers a
# served Llama-3.1 gives, i.e. on-policy for the draft.
SAMPLING=(--temperature 0.6 --top-p 0.9 --max-tokens 2048)
# 32,000 of 128,256 ids: the size of the published EAGLE-3 drafts for 8B targets; it cuts the
# draft's LM head 4x (131M instead of 525M weights, the largest tensor it computes each TTT step)
# and the most frequent answer tokens are expected to cover nearly all answer positions. The
# vocab step prints the coverage measured on the real data: below ~0.99, raise the size
# (acceptance is capped by coverage).
VOCAB_ARGS=(--draft-vocab-size 32000)

# shellcheck source=recipes/dense-flags.sh
source recipes/dense-flags.sh  # the rest (run from the repository root, as pipeline.sh is)
