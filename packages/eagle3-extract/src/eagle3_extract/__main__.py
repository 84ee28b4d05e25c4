"""``python -m eagle3_extract``: the CLI, for interpreters without the console script (vLLM's venv).

The guard matters: vLLM starts its engine in a *spawned* process, which re-imports the main
module; without it every engine process would run the CLI again.
"""

import sys

from eagle3_extract.cli import main

if __name__ == "__main__":
    sys.exit(main())
