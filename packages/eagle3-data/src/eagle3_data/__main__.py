import sys

from eagle3_data.cli import main

sys.exit(main())
