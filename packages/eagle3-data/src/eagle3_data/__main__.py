"""``python -m eagle3_data``: the eagle3-data command line."""

import sys

from eagle3_data.cli import main

# Guarded: vLLM's engine spawns processes that re-import the main module.
if __name__ == "__main__":
    sys.exit(main())
