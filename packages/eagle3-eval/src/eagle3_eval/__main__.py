"""``python -m eagle3_eval``: the eagle3-eval command line."""

import sys

from eagle3_eval.cli import main

# Guarded: vLLM's engine spawns processes that re-import the main module; creating an LLM at
# import time there would recurse.
if __name__ == "__main__":
    sys.exit(main())
