# shellcheck shell=bash disable=SC2034  # read by recipes/tiny/pipeline.sh, which sources it
# The tiny agent target (Kimi-K2.5's chat format, thinking and tool calls): its corpus is the
# seeded program's (instant, thinking and agent rows), made the same on every Python.
CORPUS=(env PYTHONPATH=tests uv run --frozen python -m support.agent_corpus)
# The corpus answers as written: the target was trained on exactly them, and the offline
# regeneration engine refuses rows that declare tools (tools_need_endpoint).
regenerate="${REGENERATE:-0}"
max_length=1024   # a tool declaration, an agent loop's calls and results: up to ~450 tokens
draft_vocab=1024  # of the target's 2,048
