# shellcheck shell=bash disable=SC2034  # read by recipes/tiny/pipeline.sh, which sources it
# The target that knows its corpus by heart (functions and module docstrings of the stdlib): its
# draft trains on the conversations of the "train" files and is measured on the others.
CORPUS=(uv run --frozen tools/targets/build_tiny_recall_target.py --corpus-only)
# The corpus answers as written: the target was trained on exactly them, tens of epochs over.
regenerate="${REGENERATE:-0}"
draft_vocab=1024  # of the target's 2,048
