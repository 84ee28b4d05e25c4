"""``python -m eagle3_train`` / ``accelerate launch -m eagle3_train``."""

import sys

from eagle3_train.cli import main

sys.exit(main())
