import sys

from eagle3_recipe.cli import main

sys.exit(main())
